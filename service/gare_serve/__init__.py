"""The HTTP service (`gare-serve`): FastAPI routes over gare_search, with auth, limits, metrics and a page."""
