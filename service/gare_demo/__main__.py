"""`python -m gare_demo`: the README demo."""

from gare_demo.demo import main

raise SystemExit(main())
