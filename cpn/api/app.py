"""The aiohttp application: state, middlewares, routes."""

from __future__ import annotations

import gc
import importlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web

from cpn.api import metrics, middleware, security_headers, state, wiring, workers
from cpn.api.longpolls import LONG_POLLS, LongPolls
from cpn.api.routes import resources, system
from cpn.core.db import Database
from cpn.core.migrate import upgrade_async
from cpn.core.settings import Settings, get_settings
from layers.orchestration.identity import ratelimit
from layers.resource.blobs import BlobStore

# connections the kernel queues before accept(): aiohttp's default 128 drops the SYNs of a burst of
# agents or submissions beyond it, and each dropped client waits out a 1 s SYN retransmission
LISTEN_BACKLOG = 2048
WEB_DIR = Path(__file__).resolve().parents[2] / "web"


def create_app(settings: Settings | None = None, db: Database | None = None, *, migrate: bool = True) -> web.Application:
    settings = settings or get_settings()
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[middleware.errors_middleware, metrics.metrics_middleware,
                     middleware.auth_middleware, middleware.audit_middleware],
    )
    app[state.SETTINGS] = settings
    app[state.DB] = db or Database(settings.effective_database_url, share=settings.workers or 1)
    app[state.BLOBS] = BlobStore.of(settings)
    app[state.KINDS] = wiring.build_registry(settings, app[state.BLOBS])
    app[state.DOCS] = []
    app[LONG_POLLS] = LongPolls()
    app[middleware.RATE] = ratelimit.limiter_for(app[state.DB], settings.rate_limit_per_minute)
    if migrate:  # a cleanup context, so it runs before the reconciler's (contexts start in order)
        app.cleanup_ctx.append(_migrate)
    app.on_startup.append(_warm_planner)
    app.on_response_prepare.append(security_headers.add)
    metrics.install(app)
    system.setup(app)
    resources.setup(app)
    wiring.setup_layer_routes(app)
    _static(app)
    app.on_cleanup.append(_dispose)
    return app


def _static(app: web.Application) -> None:
    if (WEB_DIR / "index.html").exists():
        async def index(_: web.Request) -> web.FileResponse:
            return web.FileResponse(WEB_DIR / "index.html")

        app.router.add_get("/", index)
        app.router.add_get("/ui", index)
        app.router.add_static("/ui/static", WEB_DIR, show_index=False)


async def _migrate(app: web.Application) -> AsyncIterator[None]:
    await upgrade_async(app[state.DB].url)
    yield


async def _warm_planner(_: web.Application) -> None:
    """Import the solvers (scipy's HiGHS) before serving: imported lazily by the first quote, they
    held the event loop for ~1.5 s in the middle of the first burst of submissions."""
    importlib.import_module("layers.orchestration.planning.exact")
    importlib.import_module("layers.orchestration.planning.heuristic")


GC_YOUNG_THRESHOLD = 20_000  # allocations between young collections (CPython's default is 700)


async def _tune_gc(_: web.Application) -> None:
    """A request allocates thousands of short-lived objects (ORM rows, JSON): with the default
    threshold the collector ran every few hundred and, with everything imported at start-up in the
    old generation, walked the whole heap often. The start-up objects are frozen out of collection."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


async def _dispose(app: web.Application) -> None:
    await app[state.DB].dispose()


def serve(settings: Settings) -> None:
    """Serve the API: one process, or ``settings.effective_workers`` sharing the port (PostgreSQL)."""
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    count = settings.effective_workers
    socks = _listen(settings)  # before the database is touched: a taken port changes nothing
    if count == 1:
        app = create_app(settings)
        app.on_startup.append(_announce(settings, 1))
        app.on_startup.append(_tune_gc)
        web.run_app(app, sock=socks, print=None, **_LIMITS)
        return
    workers.migrate(settings.effective_database_url)
    settings = settings.model_copy(update={"workers": count})  # each worker takes 1/count of the connections

    def start(shared: list[socket.socket], index: int) -> None:
        app = create_app(settings, migrate=False)
        if index == 0:
            app.on_startup.append(_announce(settings, count))
        app.on_startup.append(_tune_gc)
        web.run_app(app, sock=shared, print=None, **_LIMITS)

    raise SystemExit(workers.run(count, socks, start))


def _listen(settings: Settings) -> list[socket.socket]:
    """The listening sockets, or one line saying why there are none (exit 1, no traceback)."""
    try:
        return workers.bind(settings.host, settings.port, LISTEN_BACKLOG)
    except OSError as exc:
        raise SystemExit(f"error: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc} "
                         "(another cpn serve there? choose another with --port or CPN_PORT)") from None


# long request lines (label selectors, continue tokens) get a JSON 4xx from CPN, not aiohttp's text 400
_LIMITS = {"max_line_size": 65536, "max_field_size": 16384,  # aiohttp ≥ 3.14 takes the handler's limits directly
           # on SIGTERM, requests still running after this are cancelled (their transactions roll back): the
           # agents' 15 s long polls held a stop for 8-14 s, and their clients retry anyway
           "shutdown_timeout": 3.0}


def _announce(settings: Settings, count: int) -> Callable[[web.Application], Awaitable[None]]:
    async def announce(_: web.Application) -> None:
        from sqlalchemy.engine import make_url

        database = make_url(settings.effective_database_url).render_as_string(hide_password=True)
        logging.getLogger("cpn.api").info("CPN API serving on http://%s:%s (portal at /, database %s%s)",
                                             settings.host, settings.port, database,
                                             f", {count} worker processes" if count > 1 else "")

    return announce
