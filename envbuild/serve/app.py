"""The HTTP application: routing, the two authentication rules, and running it.

A port request (``envbuild.serve.ports``: ``Host: PORT-ID.…`` or an ``E2b-Sandbox-Port``
other than envd's) goes to that port inside the sandbox, with its traffic token. Others by
path: the control plane (``/[v2/]sandboxes…``, ``/snapshots``, ``/templates/…``; needs ``X-API-KEY``)
and envd (``/process.Process/…``, ``/filesystem.Filesystem/…``, ``/files``, ``/health``;
needs ``E2b-Sandbox-Id`` naming a live sandbox and that sandbox's ``X-Access-Token``). A
sandbox that is unknown or was killed gets what E2B's proxy answers, 502 "The sandbox … was
not found", which the SDK turns into ``SandboxNotRunningException`` / ``is_running() ==
False``; the control plane answers 404. A paused sandbox with auto-resume
(``envbuild.serve.lifecycle``) is resumed first, for a request that shows its token.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process.process_connect import ProcessASGIApplication

from envbuild.serve import control, control_net, files, observe, ports, snapshots
from envbuild.serve.asgi import call_asgi
from envbuild.serve.auth import ApiKeys, same_token
from envbuild.serve.envd_fs import FilesystemService
from envbuild.serve.envd_process import ProcessService
from envbuild.serve.records import RecordDir
from envbuild.serve.sandboxes import Backend, Registry

API_KEYS = web.AppKey("api_keys", ApiKeys)
#: One Connect message (a request) at most: envd's requests are paths and small configs.
MAX_RPC_MESSAGE = 1 << 20
_CONTROL = ("/sandboxes", "/v2/sandboxes", "/snapshots", "/templates/")
_ENVD = ("/process.Process/", "/filesystem.Filesystem/")


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What ``envbuild serve`` runs: where it listens, who may use it, where sandboxes come
    from (``backend``: ``envbuild.serve.backend.NodeBackend``) and the bounds. ``records``:
    the directory of the sandboxes' records (``envbuild.serve.records``; None: none kept, a
    sandbox then never outlives the server); ``keep_on_exit``: a stop leaves the sandboxes
    running for the next server over ``records`` (else it kills them)."""

    backend: Backend
    api_keys: ApiKeys
    records: Path | None = None
    keep_on_exit: bool = True
    host: str = "127.0.0.1"
    port: int = 49982
    max_timeout: float = 24 * 3600
    max_sandboxes: int = 256
    max_upload: int = 256 << 20


def _json_error(status: int, message: str, code: str | int | None = None) -> web.Response:
    return web.json_response({"code": code if code is not None else status,
                              "message": message}, status=status)


@web.middleware
async def _authenticate(request: web.Request, handler: Callable[[web.Request], Awaitable[
        web.StreamResponse]]) -> web.StreamResponse:
    path = request.path
    port = ports.target(request)
    if port is not None:
        return await _port(request, *port)
    if path.startswith(_CONTROL):
        if not request.app[API_KEYS].accepts(request.headers.get("X-API-KEY")):
            return _json_error(401, "Invalid API key")
        return await handler(request)
    if path.startswith(_ENVD) or path in ("/files", "/health"):
        sid = request.headers.get("E2b-Sandbox-Id", "")
        entry = await request.app[control.REGISTRY].wake(sid, lambda e: same_token(
            request.headers.get("X-Access-Token"), e.token))
        if entry is None:
            return _json_error(502, f"The sandbox {sid[:64]} was not found", "unavailable")
        if not same_token(request.headers.get("X-Access-Token"), entry.token):
            return _json_error(401, "the sandbox's access token is missing or wrong",
                               "unauthenticated")
        request[files.ENTRY] = entry
        return await handler(request)
    return _json_error(404, f"no route {path[:200]}")


async def _port(request: web.Request, sid: str, port: str) -> web.StreamResponse:
    entry = await request.app[control.REGISTRY].wake(
        sid, lambda e: ports.authorized(request, e))
    if entry is None:
        return _json_error(502, f"The sandbox {sid[:64]} was not found", "unavailable")
    if not ports.authorized(request, entry):
        return _json_error(401, f"the sandbox's traffic access token is missing or wrong "
                                f"(header {ports.TRAFFIC_HEADER})", "unauthenticated")
    return await ports.handle(request, entry, port, request.app[files.MAX_UPLOAD])


def make_app(options: ServeOptions) -> web.Application:
    records = RecordDir(options.records) if options.records is not None else None
    registry = Registry(options.backend, max_timeout=options.max_timeout,
                        max_sandboxes=options.max_sandboxes, records=records)
    app = web.Application(middlewares=[_authenticate], client_max_size=control.MAX_JSON)
    app[API_KEYS] = options.api_keys
    app[control.REGISTRY] = registry
    app[files.MAX_UPLOAD] = options.max_upload
    app[snapshots.SNAPSHOTS] = snapshots.Snapshots(options.backend.store)
    process_app = ProcessASGIApplication(ProcessService(registry),
                                         read_max_bytes=MAX_RPC_MESSAGE)
    fs_app = FilesystemASGIApplication(FilesystemService(registry),
                                       read_max_bytes=MAX_RPC_MESSAGE)

    async def process(request: web.Request) -> web.StreamResponse:
        return await call_asgi(process_app, request, MAX_RPC_MESSAGE + 5)

    async def filesystem(request: web.Request) -> web.StreamResponse:
        return await call_asgi(fs_app, request, MAX_RPC_MESSAGE + 5)

    app.router.add_post("/process.Process/{method}", process)
    app.router.add_post("/filesystem.Filesystem/{method}", filesystem)
    observe.add_routes(app)  # first: /sandboxes/metrics is not /sandboxes/{id}
    control.add_routes(app)
    control_net.add_routes(app)
    files.add_routes(app)
    snapshots.add_routes(app)

    async def reattach(app: web.Application) -> None:
        if records is not None:
            records.claim()
            await registry.reattach()

    async def stop(app: web.Application) -> None:
        if records is not None and options.keep_on_exit:
            await registry.detach_all()
        else:
            await registry.close_all()

    async def release(app: web.Application) -> None:
        if records is not None:
            records.release()

    app.on_startup.append(reattach)
    # on shutdown, before aiohttp waits for open requests: a command's stream then ends (the
    # server lets go of it, or its sandbox is gone) instead of holding the server up to its
    # shutdown timeout
    app.on_shutdown.append(stop)
    app.on_cleanup.append(release)
    return app


async def start(options: ServeOptions) -> tuple[web.AppRunner, str]:
    """Start serving (in the running loop; the sandboxes of ``options.records`` re-attached
    first); the runner (``await runner.cleanup()`` stops it and leaves or kills every
    sandbox, as ``options.keep_on_exit`` says) and the URL it listens on."""
    from runtime_shim.node import hold_pools

    hold_pools()  # the server owns its node: empty pools kept for their grace (diskpool)
    runner = web.AppRunner(make_app(options), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port, reuse_address=True)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or ()
    host, port = sockets[0].getsockname()[:2] if sockets else (options.host, options.port)
    return runner, f"http://{host}:{port}"


async def serve_forever(options: ServeOptions, on_ready: Callable[[str], None] | None = None,
                        stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or the task is cancelled), then leave or kill every
    sandbox (``options.keep_on_exit``)."""
    runner, url = await start(options)
    if on_ready is not None:
        on_ready(url)
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()


