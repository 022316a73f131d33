"""E2B's metrics and logs of a sandbox: ``GET /sandboxes/{id}/metrics`` (the SDK's
``get_metrics``), ``GET /sandboxes/metrics?sandbox_ids=…`` (the latest of each),
``GET /sandboxes/{id}/logs`` and ``GET /v2/sandboxes/{id}/logs`` (the events of
``envbuild.serve.events``).

**Metrics** are samples of ``Sandbox.usage()`` (``runtime_shim.node.usage``: the sandbox's
cgroups and its disk) the server takes every ``INTERVAL`` seconds for each running sandbox, and
when a request finds none newer than a second; the newest ``MAX_SAMPLES`` (an hour) are kept,
in memory. A sample says: ``cpuCount`` (the sandbox's CPUs), ``cpuUsedPct`` (the CPU time its
processes used since the previous reading, as a percentage of those CPUs' time), ``memUsed``
(page cache included) and ``memCache``, ``memTotal`` (its memory limit), ``diskUsed`` and
``diskTotal`` (its disk and cap; 0 without a disk cap). A sandbox's first reading is only the
base of the next (a rate needs two). A backend that reports no usage (microVMs) has no
samples; a paused sandbox keeps the samples taken while it ran. ``start``/``end`` (Unix
seconds) select a time range.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import logging
from typing import Any

from aiohttp import web

from envbuild.errors import EnvbuildError
from envbuild.serve import control
from envbuild.serve.events import Event
from envbuild.serve.sandboxes import Entry, Registry

_log = logging.getLogger(__name__)
#: Seconds between two samples of every running sandbox (E2B's interval too).
INTERVAL = 5.0
#: Samples kept per sandbox: an hour at ``INTERVAL``.
MAX_SAMPLES = 720
#: Sandboxes ``/sandboxes/metrics`` reports at most in one request.
MAX_IDS = 100


@dataclasses.dataclass
class _Series:
    """One sandbox's samples, and the last reading (the base of the next sample's rate)."""

    samples: collections.deque[dict[str, Any]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=MAX_SAMPLES))
    last: Any = None  # runtime_shim SandboxUsage
    source: Any = None  # the runtime_shim sandbox it was read from (a resume is a new one)


class Metrics:
    """The samples of every sandbox of ``registry``, by E2B id."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._series: dict[str, _Series] = {}
        self.task: asyncio.Task[None] | None = None  # the sampler, while the server runs

    def series(self, sandbox_id: str) -> _Series:
        return self._series.setdefault(sandbox_id, _Series())

    async def read(self, entry: Entry) -> bool:
        """Take a reading of ``entry`` (a sample if there is a base); False if none."""
        sandbox = entry.sandbox
        if sandbox is None or entry.state != "running":
            return False
        try:
            usage = await sandbox.usage()
        except (EnvbuildError, AttributeError):  # closed meanwhile, or not reported
            return False
        s = self.series(entry.id)
        if s.source is sandbox and s.last is not None and usage.at > s.last.at:
            s.samples.append(_metric(entry, s.last, usage))
        s.last, s.source = usage, sandbox
        return True

    async def sample_all(self) -> None:
        """One reading of every running sandbox; the series of sandboxes gone are dropped."""
        live = {e.id: e for e in self.registry.all()}
        for sid in [s for s in self._series if s not in live]:
            del self._series[sid]
        for entry in live.values():
            await self.read(entry)

    async def fresh(self, entry: Entry) -> list[dict[str, Any]]:
        """``entry``'s samples, with one of now unless the newest is under a second old."""
        s = self.series(entry.id)
        if s.last is None or s.source is not entry.sandbox:
            if not await self.read(entry):
                return list(s.samples)
            await asyncio.sleep(0.25)  # that was a base: the sample follows
        if not s.samples or s.last.at < _now() - 1.0:
            await self.read(entry)
        return list(s.samples)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL)
            try:
                await self.sample_all()
            except Exception:  # noqa: BLE001 - a sampler that dies would serve stale data
                _log.exception("sample the sandboxes' usage")


def _now() -> float:
    return datetime.datetime.now(datetime.UTC).timestamp()


def _metric(entry: Entry, before: Any, now: Any) -> dict[str, Any]:
    """E2B's ``SandboxMetric`` from two readings of one sandbox."""
    cpus = now.cpus or entry.cpus or 1
    pct = (now.cpu_seconds - before.cpu_seconds) / (now.at - before.at) / cpus * 100
    at = datetime.datetime.fromtimestamp(now.at, datetime.UTC)
    return {"timestamp": at.isoformat().replace("+00:00", "Z"), "timestampUnix": int(now.at),
            "cpuCount": max(1, round(cpus)), "cpuUsedPct": round(max(0.0, pct), 2),
            "memUsed": now.memory_bytes, "memCache": now.memory_cache,
            "memTotal": now.memory_limit or entry.memory_mb << 20,
            "diskUsed": now.disk_bytes or 0, "diskTotal": now.disk_limit or 0}


METRICS = web.AppKey("metrics", Metrics)


def _int_param(request: web.Request, name: str) -> int | None:
    value = request.query.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be an integer") from None


async def sandbox_metrics(request: web.Request) -> web.Response:
    """``GET /sandboxes/{id}/metrics?start=&end=`` (Unix seconds): the samples in range."""
    entry = control.entry_of(request)
    start, end = _int_param(request, "start"), _int_param(request, "end")
    samples = await request.app[METRICS].fresh(entry)
    return web.json_response([m for m in samples
                              if (start is None or m["timestampUnix"] >= start)
                              and (end is None or m["timestampUnix"] <= end)])


async def sandboxes_metrics(request: web.Request) -> web.Response:
    """``GET /sandboxes/metrics?sandbox_ids=a,b``: the newest sample of each running one."""
    ids = [i for i in request.query.get("sandbox_ids", "").split(",") if i][:MAX_IDS + 1]
    if len(ids) > MAX_IDS:
        return control.error(400, f"at most {MAX_IDS} sandbox_ids")
    found: dict[str, Any] = {}
    for sid in ids:
        entry = request.app[control.REGISTRY].get(sid)
        if entry is not None and (samples := await request.app[METRICS].fresh(entry)):
            found[sid] = samples[-1]
    return web.json_response({"sandboxes": found})


def _entry_json(e: Event) -> dict[str, Any]:
    at = datetime.datetime.fromtimestamp(e.at, datetime.UTC).isoformat().replace("+00:00", "Z")
    return {"timestamp": at, "message": e.message, "level": e.level, "fields": e.fields}


def _limit(request: web.Request) -> int:
    limit = _int_param(request, "limit")
    if limit is not None and not 0 <= limit <= 1000:
        raise web.HTTPBadRequest(text="limit is 0 to 1000")
    return 1000 if limit is None else limit


async def logs(request: web.Request) -> web.Response:
    """``GET /sandboxes/{id}/logs?start=&limit=`` (``start`` in Unix milliseconds)."""
    entry = control.entry_of(request)
    start = _int_param(request, "start")
    found = entry.events.select(start=None if start is None else start / 1000,
                                limit=_limit(request))
    entries = [_entry_json(e) for e in found]
    return web.json_response({"logs": [{"timestamp": e["timestamp"], "line": e["message"]}
                                       for e in entries], "logEntries": entries})


async def logs_v2(request: web.Request) -> web.Response:
    """``GET /v2/sandboxes/{id}/logs?cursor=&limit=&direction=&level=&search=`` (``cursor``
    in Unix milliseconds)."""
    entry = control.entry_of(request)
    cursor = _int_param(request, "cursor")
    found = entry.events.select(start=None if cursor is None else cursor / 1000,
                                level=request.query.get("level"),
                                search=request.query.get("search") or None,
                                backward=request.query.get("direction") == "backward",
                                limit=_limit(request))
    return web.json_response({"logs": [_entry_json(e) for e in found]})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/sandboxes/metrics", sandboxes_metrics)
    app.router.add_get("/sandboxes/{sandbox_id}/metrics", sandbox_metrics)
    app.router.add_get("/sandboxes/{sandbox_id}/logs", logs)
    app.router.add_get("/v2/sandboxes/{sandbox_id}/logs", logs_v2)

    metrics = app[METRICS] = Metrics(app[control.REGISTRY])  # the registry is set first

    async def start(app: web.Application) -> None:
        metrics.task = asyncio.get_running_loop().create_task(metrics.run())

    async def stop(app: web.Application) -> None:
        if metrics.task is not None:
            metrics.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await metrics.task

    app.on_startup.append(start)
    # on shutdown, and before the server's own handler (make_app registers these routes
    # first): no reading of a sandbox while the server closes or leaves them
    app.on_shutdown.append(stop)
