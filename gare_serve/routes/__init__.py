"""The HTTP routes as APIRouters, one module per group: search, videos, admin (index info, reload), ops.

Routes are thin: they validate, call :mod:`gare_search.search` (through the micro-batcher) or the index
reader, and shape the response (``gare_serve.schemas``)."""
