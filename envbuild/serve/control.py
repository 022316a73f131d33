"""E2B's control plane (``spec/openapi.yml`` of e2b-dev/infra), the part envbuild serves:
create (``POST /sandboxes``, ``POST /v2/sandboxes``), get, list (``GET /sandboxes``,
``GET /v2/sandboxes`` with the ``metadata``, ``state``, ``template`` and ``startedAfter``
filters, ``order`` and pages of ``limit``), kill, timeout, connect, pause and resume
(``connect`` resumes a paused sandbox too, answering 201 then), snapshots (``create`` takes a
snapshot's id as its template) and fork. A create's ``autoPause``, ``autoPauseMemory`` and
``autoResume`` set the sandbox's lifecycle (``envbuild.serve.lifecycle``), which ``get``
reports as ``lifecycle``.

Every route needs the ``X-API-KEY`` header to hold a configured key (``envbuild.serve.auth``);
bodies are JSON of at most ``MAX_JSON`` bytes. Errors are E2B's ``{"code", "message"}``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import secrets
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from envbuild.errors import EnvbuildError
from envbuild.serve import egress, ports, snapshots
from envbuild.serve.lifecycle import Lifecycle, LifecycleRefused
from envbuild.serve.sandboxes import DEFAULT_TIMEOUT, Conflict, Entry, Registry
from runtime_shim import LockNotFound

#: The envd protocol version envbuild's envd speaks (the SDK gates features on it): 0.5.7
#: has default users, stdin control and octet-stream uploads, not file metadata (0.6.2).
ENVD_VERSION = "0.5.7"
MAX_JSON = 64 << 10
CLIENT_ID = "envbuild"

REGISTRY = web.AppKey("registry", Registry)


def error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


def created_json(e: Entry, domain: str) -> dict[str, Any]:
    """E2B's ``Sandbox``: what create and connect return (``domain``: ``ports.domain``)."""
    return {"templateID": e.template, "sandboxID": e.id, "clientID": CLIENT_ID,
            "envdVersion": ENVD_VERSION, "envdAccessToken": e.token, "domain": domain,
            "trafficAccessToken": e.traffic_token}


def listed_json(e: Entry) -> dict[str, Any]:
    """E2B's ``ListedSandbox`` (and ``SandboxDetail`` with the token)."""
    return {"templateID": e.template, "sandboxID": e.id, "clientID": CLIENT_ID,
            "startedAt": _iso(e.started_at), "endAt": _iso(e.end_at), "cpuCount": e.cpus,
            "memoryMB": e.memory_mb, "diskSizeMB": e.disk_mb, "state": state(e),
            "envdVersion": ENVD_VERSION, "metadata": e.metadata}


def state(e: Entry) -> str:
    """E2B's ``SandboxState``: one being paused or resumed is still ``running``."""
    return "paused" if e.state == "paused" else "running"


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object, at most ``MAX_JSON`` bytes (413 past it, 400 if not an object)."""
    if request.content_length is not None and request.content_length > MAX_JSON:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_JSON, actual_size=request.content_length)
    raw = await request.content.read(MAX_JSON + 1)
    if len(raw) > MAX_JSON:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_JSON, actual_size=len(raw))
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="request body must be a JSON object")
    return body


def _str_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in value.items()):
        raise web.HTTPBadRequest(text=f"{what} must be an object of strings")
    return value


def _timeout(body: dict[str, Any], default: float | None) -> float | None:
    t = body.get("timeout", default)
    if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or t < 0):
        raise web.HTTPBadRequest(text="timeout must be a non-negative number of seconds")
    return t


async def create(request: web.Request) -> web.Response:
    reg = request.app[REGISTRY]
    body = await json_body(request)
    template = body.get("templateID")
    if not isinstance(template, str) or not template:
        return error(400, "templateID is required: an env name, ref or lock digest")
    timeout = _timeout(body, DEFAULT_TIMEOUT)
    metadata = _str_map(body.get("metadata"), "metadata")
    env_vars = _str_map(body.get("envVars"), "envVars")
    try:
        network = egress.create_network(body)
        lifecycle = Lifecycle.from_body(body, timeout or DEFAULT_TIMEOUT)
        if lifecycle.on_timeout == "pause" and lifecycle.memory and not reg.backend.keeps_memory:
            raise LifecycleRefused("autoPause with memory is not available here (this server "
                                   "keeps a paused sandbox's files only): ask for on_timeout "
                                   "{'action': 'pause', 'mode': 'filesystem'}")
    except egress.NetworkRefused as e:
        return error(400, e.line())
    except LifecycleRefused as e:
        return error(400, str(e))
    if not reg.room(1):
        return error(429, f"this server runs at most {reg.max_sandboxes} sandboxes")
    try:
        entry = await reg.open(template, timeout=timeout or DEFAULT_TIMEOUT,
                               metadata=metadata, env_vars=env_vars, network=network,
                               lifecycle=lifecycle)
    except LockNotFound as e:
        return error(404, f"template {template!r} not found: {e.message}")
    except EnvbuildError as e:
        return error(500, f"create sandbox: {e.message}")
    return web.json_response(created_json(entry, ports.domain(request)), status=201)


def entry_of(request: web.Request) -> Entry:
    """The served sandbox the path's ``{sandbox_id}`` names; a clean 404 if none."""
    sid = request.match_info["sandbox_id"]
    entry = request.app[REGISTRY].find(sid)
    if entry is None:
        raise web.HTTPNotFound(text=json.dumps({"code": 404,
                                                "message": f"sandbox {sid} was not found"}),
                               content_type="application/json")
    return entry


async def get(request: web.Request) -> web.Response:
    entry = entry_of(request)
    return web.json_response({**listed_json(entry), "envdAccessToken": entry.token,
                              "lifecycle": entry.lifecycle.described(),
                              **egress.described(entry.network)})


#: Sandboxes one page of a list holds at most (E2B's default and maximum ``limit``).
MAX_PAGE = 100


@dataclasses.dataclass(frozen=True)
class ListQuery:
    """``GET /v2/sandboxes``' filters and page (E2B's query parameters)."""

    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    states: frozenset[str] = frozenset()
    template: str | None = None
    started_after: float | None = None
    ascending: bool = False  # E2B: newest first unless order=asc
    limit: int = MAX_PAGE
    offset: int = 0  # the page's start (nextToken)

    @classmethod
    def from_params(cls, q: Mapping[str, str]) -> ListQuery:
        metadata = {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in
                    urllib.parse.parse_qsl(q.get("metadata", ""), keep_blank_values=True)}
        try:
            after = q.get("startedAfter")
            started_after = datetime.datetime.fromisoformat(after).timestamp() if after else None
            limit = int(q.get("limit", MAX_PAGE))
            offset = int(q.get("nextToken", "0"))
        except ValueError as e:
            raise web.HTTPBadRequest(text=f"bad list query: {e}") from None
        if not 0 < limit <= MAX_PAGE or offset < 0:
            raise web.HTTPBadRequest(text=f"limit is 1 to {MAX_PAGE}; nextToken as returned")
        return cls(metadata=metadata, states=frozenset(s for s in q.get("state", "").split(",")
                                                       if s),
                   template=q.get("template") or None, started_after=started_after,
                   ascending=q.get("order") == "asc", limit=limit, offset=offset)

    def matches(self, e: Entry) -> bool:
        return ((not self.states or state(e) in self.states)
                and (self.template is None or e.template == self.template)
                and (self.started_after is None or e.started_at >= self.started_after)
                and all(e.metadata.get(k) == v for k, v in self.metadata.items()))

    def page(self, entries: list[Entry]) -> tuple[list[Entry], str | None]:
        """The entries of this page, in order, and the next page's token (None: last)."""
        found = sorted((e for e in entries if self.matches(e)),
                       key=lambda e: (e.started_at, e.id), reverse=not self.ascending)
        end = self.offset + self.limit
        return found[self.offset:end], str(end) if end < len(found) else None


async def list_sandboxes(request: web.Request) -> web.Response:
    query = ListQuery.from_params(request.query)
    page, next_token = query.page(request.app[REGISTRY].all())
    headers = {"x-next-token": next_token} if next_token else {}
    return web.json_response([listed_json(e) for e in page], headers=headers)


async def kill(request: web.Request) -> web.Response:
    entry = entry_of(request)
    try:
        await request.app[REGISTRY].kill(entry.id)
    except Conflict as e:
        return error(409, e.message)
    return web.Response(status=204)


async def set_timeout(request: web.Request) -> web.Response:
    entry = entry_of(request)
    timeout = _timeout(await json_body(request), None)
    if timeout is None:
        return error(400, "timeout is required")
    request.app[REGISTRY].set_timeout(entry, timeout)
    return web.Response(status=204)


async def connect(request: web.Request) -> web.Response:
    entry = entry_of(request)
    body = await json_body(request)
    timeout = _timeout(body, None)
    await request.app[REGISTRY].settle(entry)  # a pause (at its timeout) under way ends first
    if entry.state != "running":  # E2B: connecting to a paused sandbox resumes it
        return await _resume(request, entry, timeout, body.get("memory") is not False)
    if timeout is not None:  # E2B: connecting only ever extends the sandbox's life
        if time.time() + timeout > entry.end_at:
            request.app[REGISTRY].set_timeout(entry, timeout)
    return web.json_response(created_json(entry, ports.domain(request)), status=200)


async def pause(request: web.Request) -> web.Response:
    """``POST /sandboxes/{id}/pause`` (``memory``: false saves the files only): 204; 409 if
    it is not running; 500 with the reason when it cannot be saved (it then runs on)."""
    entry = entry_of(request)
    memory = (await json_body(request)).get("memory", True)
    if not isinstance(memory, bool):
        return error(400, "memory must be true or false")
    try:
        await request.app[REGISTRY].pause(entry, memory=memory)
    except Conflict as e:
        return error(409, e.message)
    except EnvbuildError as e:
        return error(500, f"pause sandbox {entry.id}: {e.message}")
    return web.Response(status=204)


async def resume(request: web.Request) -> web.Response:
    """``POST /sandboxes/{id}/resume`` (E2B's deprecated form of ``connect``): 201."""
    entry = entry_of(request)
    body = await json_body(request)
    await request.app[REGISTRY].settle(entry)
    return await _resume(request, entry, _timeout(body, None), True)


async def _resume(request: web.Request, entry: Entry, timeout: float | None,
                  memory: bool) -> web.Response:
    try:
        await request.app[REGISTRY].resume(entry, timeout=timeout or DEFAULT_TIMEOUT,
                                           memory=memory)
    except Conflict as e:
        return error(409, e.message)
    except EnvbuildError as e:
        return error(500, f"resume sandbox {entry.id}: {e.message}")
    return web.json_response(created_json(entry, ports.domain(request)), status=201)


#: Sandboxes one fork may make (E2B's maximum ``count``).
MAX_FORKS = 20
_SNAPSHOT_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")


async def snapshot(request: web.Request) -> web.Response:
    """``POST /sandboxes/{id}/snapshots`` (``name``, ``memory``): 201 with the snapshot's id,
    a template for ``create`` (``envbuild.serve.backend``); the sandbox runs on."""
    entry = entry_of(request)
    body = await json_body(request)
    name, memory = body.get("name"), body.get("memory", True)
    if name is None:
        name = f"{entry.id}-{secrets.token_hex(4)}"
    if not isinstance(name, str) or not _SNAPSHOT_NAME.fullmatch(name):
        return error(400, "name: 1 to 128 of a-z 0-9 . _ -, starting with a letter or digit")
    if not isinstance(memory, bool):
        return error(400, "memory must be true or false")
    try:
        ref = await request.app[REGISTRY].snapshot(entry, name, memory=memory)
        request.app[snapshots.SNAPSHOTS].mark(ref, entry.id)  # for list_snapshots(sandbox_id)
    except Conflict as e:
        return error(409, e.message)
    except EnvbuildError as e:
        return error(500, f"snapshot sandbox {entry.id}: {e.message}")
    return web.json_response({"snapshotID": ref, "names": [ref]}, status=201)


async def fork(request: web.Request) -> web.Response:
    """``POST /sandboxes/{id}/fork`` (``count`` 1 to ``MAX_FORKS``, ``timeout``): 201 with
    one result per fork, a sandbox or an error; the sandbox runs on."""
    entry = entry_of(request)
    body = await json_body(request)
    count, timeout = body.get("count", 1), _timeout(body, 15)  # E2B's defaults
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
        return error(400, f"count must be 1 to {MAX_FORKS}")
    reg = request.app[REGISTRY]
    if not reg.room(count):
        return error(429, f"this server runs at most {reg.max_sandboxes} sandboxes")
    try:
        made = await reg.fork(entry, count, timeout or 15)
    except Conflict as e:
        return error(409, e.message)
    except EnvbuildError as e:
        return error(500, f"fork sandbox {entry.id}: {e.message}")
    domain = ports.domain(request)
    return web.json_response([
        {"error": {"code": 500, "message": f"fork: {getattr(c, 'message', c)}"}}
        if isinstance(c, Exception) else {"sandbox": created_json(c, domain)} for c in made],
        status=201)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/sandboxes", create)
    app.router.add_post("/v2/sandboxes", create)
    app.router.add_get("/sandboxes", list_sandboxes)
    app.router.add_get("/v2/sandboxes", list_sandboxes)
    app.router.add_get("/sandboxes/{sandbox_id}", get)
    app.router.add_delete("/sandboxes/{sandbox_id}", kill)
    app.router.add_post("/sandboxes/{sandbox_id}/timeout", set_timeout)
    app.router.add_post("/sandboxes/{sandbox_id}/connect", connect)
    app.router.add_post("/v2/sandboxes/{sandbox_id}/connect", connect)
    app.router.add_post("/sandboxes/{sandbox_id}/pause", pause)
    app.router.add_post("/sandboxes/{sandbox_id}/resume", resume)
    app.router.add_post("/sandboxes/{sandbox_id}/snapshots", snapshot)
    app.router.add_post("/sandboxes/{sandbox_id}/fork", fork)
