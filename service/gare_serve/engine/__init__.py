"""The search engine the routes call: the served version, its caches, the micro-batcher and its worker."""
