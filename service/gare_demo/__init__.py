"""The README demo: generate a library, train a small model, index it and serve it (`python -m gare_demo`)."""
