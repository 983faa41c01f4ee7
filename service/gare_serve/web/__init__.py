"""The HTTP surface: the routes (search, videos, index and admin, ops and the page), their FastAPI dependencies and
request/response bodies, the API-key checks, how hits are rendered for clients, the middleware and the slow-client
limits. A route parses its request, calls the engine (``gare_serve.engine``) and maps its typed errors to HTTP."""
