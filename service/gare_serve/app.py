"""The GARE search service: a FastAPI app over one model and one (reloadable) index version.

``create_app(settings)`` builds the app; nothing heavy happens until its lifespan starts: then the
checkpoint the index names (or ``settings.checkpoint``) is hashed and checked against the manifest,
loaded on the GPU when there is one, and the index's CURRENT version is opened (``gare_serve.engine.state``).

The HTTP layer only: routes (``gare_serve.web``: search, videos, admin, ops) call the query-time search
of ``gare_search.search``; request/response bodies are in ``gare_serve.web.schemas``, the routes' dependencies
(state, key checks) in ``gare_serve.web.deps``, middleware and error handlers in ``gare_serve.web.middleware``.

Run it with ``gare-serve --index INDEX [--workers N]`` (gare_serve/cli.py) or ``uvicorn --factory
gare_serve.app:create_app`` (settings from ``GARE_*`` variables). With several workers each process builds
its app with :func:`create_app` from the environment the CLI prepared and joins the others through the
run directory (``gare_serve.engine.worker_board``).
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from gare_serve.engine.follow import follow_current
from gare_serve.engine.index_check import recheck_served
from gare_serve.engine.prometheus import Metrics, MetricsMiddleware, mark_worker_dead
from gare_serve.engine.recall_watch import start_recall_watch
from gare_serve.engine.reload import watch_reloads
from gare_serve.engine.remote_state import ENGINE_POLL_S, EngineClientState, follow_engine
from gare_serve.engine.startup import StartupError
from gare_serve.engine.state import ServiceState
from gare_serve.heap_trim import trim_when_grown
from gare_serve.settings import (
    KEY_FIELDS,
    KeyRoles,
    Settings,
    SettingsError,
    hashed_key_list,
    load_key_roles,
    load_settings,
)
from gare_serve.web import admin_routes, ops_routes, search_routes, video_routes
from gare_serve.web.http_limits import BodyTimeoutMiddleware
from gare_serve.web.middleware import (
    BodySizeLimitMiddleware,
    HeadMiddleware,
    SecurityHeadersMiddleware,
    TrustedHostMiddleware,
    install_error_handlers,
)
from gare_serve.web.ops_routes import DOCS_ASSET_DIR, DOCS_ASSETS, STATIC_DIR
from gare_serve.web.presentation import API_VERSION

log = logging.getLogger(__name__)


# The legacy key digests already warned about in this process: gare-serve builds its app twice (a check, then the
# served one), and one WARNING is enough for one configuration.
_WARNED_LEGACY: set[tuple[str, ...]] = set()


def warn_legacy_keys(keys: KeyRoles) -> None:
    """One WARNING per process and configuration when keys come from the deprecated api_keys / api_keys_file."""
    if not keys.legacy or keys.admin in _WARNED_LEGACY:
        return
    _WARNED_LEGACY.add(keys.admin)
    log.warning("GARE_API_KEYS / GARE_API_KEYS_FILE (api_keys, api_keys_file) are deprecated: their %d key(s) are "
                "taken as ADMIN keys, which may also reload the index. Give search clients GARE_SEARCH_KEYS (search "
                "only) and operators GARE_ADMIN_KEYS (admin routes and search), or their *_FILE settings", keys.legacy)


def create_app(settings: Settings | None = None, *, state_factory: Callable[[Settings, Metrics], ServiceState] = ServiceState,
               follow: Callable[[Any, float], Awaitable[None]] = follow_current, **overrides: Any) -> FastAPI:
    """Build the app (cheap: the model and index load in the lifespan). ``state_factory`` builds what the lifespan
    loads and ``follow`` follows the index on disk (a sharded index's generations in the Ray ingress,
    ``gare_serve.ray_serve.deployment``; one index's CURRENT by default)."""
    if settings is None:
        settings = load_settings(**overrides)
    elif overrides:  # model_copy skips the validators: keys given here are hashed as the settings' own are
        settings = settings.model_copy(update={
            k: hashed_key_list(v) if k in KEY_FIELDS else v for k, v in overrides.items()})
    if settings.engine == "shared" and state_factory is ServiceState:
        # an HTTP worker of gare-serve's shared engine: no model here; searches go to the engine process
        # ("auto" is decided by gare-serve, which starts the engine; anything else searches in process)
        state_factory, follow = EngineClientState, follow_engine
    metrics = Metrics()
    # API keys are read now so that a bad key file fails at once, not in the middle of serving.
    try:
        keys = load_key_roles(settings)
    except SettingsError as e:
        raise StartupError(str(e)) from None
    if settings.run_dir is None:  # the workers of gare-serve --workers: their parent has warned
        warn_legacy_keys(keys)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = state_factory(settings, metrics)
        try:
            await run_in_threadpool(state.load)
        except StartupError as e:
            log.error("gare-serve cannot start: %s", e)
            raise
        app.state.gare = state
        state.batcher.start()
        # stage-1 recall of sampled served queries (None when off; a shared engine samples its own)
        recall_watch = start_recall_watch(state) if state.runs_searches else None
        loop = asyncio.get_running_loop()
        tasks = []
        if state.board is not None:  # the other workers' admin reloads
            tasks.append(loop.create_task(watch_reloads(state, state.board), name="gare-reload-watch"))
        # a new CURRENT written by gare-index, on any host sharing the index (a shared engine follows it, and the
        # workers follow the engine)
        poll_s = settings.index_poll_s if state.runs_searches else ENGINE_POLL_S
        if poll_s > 0:
            tasks.append(loop.create_task(follow(state, poll_s), name="gare-follow-current"))
        if state.runs_searches and settings.index_check and settings.index_recheck_s > 0:  # files changed in place
            tasks.append(loop.create_task(recheck_served(state, settings.index_recheck_s), name="gare-index-recheck"))
        if settings.heap_trim_s > 0:  # the heap a burst of large answers grew, given back once they are gone
            tasks.append(loop.create_task(trim_when_grown(settings.heap_trim_s), name="gare-heap-trim"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await state.batcher.stop()
            if recall_watch is not None:
                await run_in_threadpool(recall_watch.stop)
            state.close()
            app.state.gare = None
            mark_worker_dead()

    app = FastAPI(
        docs_url=None, redoc_url=None,  # /docs is served below from local assets (no CDN: works offline, CSP-clean)
        title="GARE search",
        version="1.0",
        summary="Text-to-video search: dual-tower ANN, GARE psi rerank and NCL biases",
        description=(
            "Two-stage text-to-video retrieval. `POST /v1/search` encodes the query, takes the ANN top-K by "
            "dual-tower cosine, re-scores them with GARE's psi (pair-specific increment Δ) and adds the NCL "
            "Sinkhorn video biases. Admin routes (`/v1/admin/...`) need an admin key (`Authorization: Bearer <key>` "
            "or `X-API-Key`; a search key gets 403); search needs a search or an admin key when the server is "
            "started with `require_key_for_search`."
        ),
        lifespan=lifespan,
        openapi_tags=[
            {"name": "search", "description": "text-to-video search"},
            {"name": "videos", "description": "metadata, thumbnails and files of indexed videos"},
            {"name": "index", "description": "the served index version"},
            {"name": "admin", "description": "operations (admin key required)"},
            {"name": "ops", "description": "health and metrics"},
        ],
    )
    app.state.gare = None
    app.state.settings = settings
    app.state.keys = keys  # /metrics checks a key before the lifespan has loaded the state (sha256 digests only)
    app.state.metrics = metrics
    install_error_handlers(app)

    app.include_router(search_routes.make_router(settings))
    app.include_router(video_routes.router)
    app.include_router(admin_routes.router)
    app.include_router(admin_routes.admin_router)
    app.include_router(ops_routes.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.mount(DOCS_ASSETS, StaticFiles(directory=DOCS_ASSET_DIR), name="docs-assets")

    # ------------------------------------------------------------------ middleware (last added = outermost)
    origins = settings.cors_origin_list()
    if origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "X-API-Key", "Content-Type", "Range"],
            expose_headers=["Content-Range", "Accept-Ranges", "Content-Length"], max_age=600,
        )
    app.add_middleware(HeadMiddleware)
    app.add_middleware(SecurityHeadersMiddleware)
    app.add_middleware(TrustedHostMiddleware, allowed=settings.trusted_host_list())
    # the image upload may be larger than a JSON body (plus the multipart envelope)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes,
                       path_limits={f"/{API_VERSION}/search/image": settings.max_image_bytes + 64 * 1024})
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=settings.body_timeout_s)  # a body must arrive in time
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


__all__ = ["create_app", "warn_legacy_keys"]
