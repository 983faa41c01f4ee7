"""The HTTP routes as APIRouters, one module per group: search, videos, admin (index info, reload), ops.

Routes are thin: they validate, call :mod:`indexer.search` (through the micro-batcher) or the index
reader, and shape the response (``service.schemas``)."""
