"""The HTTP service (``gare-serve``): FastAPI routes over gare_search, grouped as ``web`` (the HTTP surface),
``engine`` (state, searches, caches, batching, metrics), ``media`` (signed URLs, thumbnails), ``processes`` (several
workers behind one port) and ``ray_serve`` (a sharded index on Ray Serve); ``app``, ``cli``, ``settings`` and the
shared ``lru`` beside them."""
