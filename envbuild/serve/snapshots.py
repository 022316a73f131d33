"""E2B's snapshot list and delete, served from the store's snapshot refs: ``GET /snapshots``
(``Sandbox.list_snapshots``: the ``sandboxID`` and ``name`` filters, pages of ``limit`` with
``nextToken``) and ``DELETE /templates/{templateID}`` (``Sandbox.delete_snapshot``; a
snapshot's id is its template id, as on E2B).

A snapshot is the ref ``e2b/snapshots/NAME`` (files and memory) or ``e2b/fs-snapshots/NAME``
(files only) that ``POST /sandboxes/{id}/snapshots`` published (``envbuild.serve.backend``);
``mark`` then annotates the ref with the E2B id of the sandbox it was taken of
(``SOURCE_ANNOTATION``), for the ``sandboxID`` filter. Listed in ref order, each as E2B's
``SnapshotInfo`` ``{"snapshotID": ref, "names": [ref]}``. Deleting removes the ref only;
``envbuild gc`` reclaims the blobs afterwards unless another ref still reaches them. Only
snapshot refs can be deleted here: any other template id (an env, a lock digest) is refused.
Both routes need an API key (``envbuild.serve.app``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from aiohttp import web

from envbuild.errors import EnvbuildError, RefNotFound
from envbuild.serve.backend import FS_SNAPSHOT_PREFIX, SNAPSHOT_PREFIX

#: The ref annotation naming the E2B sandbox a snapshot was taken of.
SOURCE_ANNOTATION = "dev.envbuild.e2b.sandbox"
PREFIXES = (SNAPSHOT_PREFIX, FS_SNAPSHOT_PREFIX)
#: Snapshots one page holds at most (E2B's default and maximum ``limit``).
MAX_PAGE = 100


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


@dataclasses.dataclass(frozen=True)
class Snapshots:
    """The snapshot refs of ``store`` (an ``envbuild.store.Store``)."""

    store: Any

    def mark(self, ref: str, sandbox_id: str) -> None:
        """Record on ``ref`` that it was taken of sandbox ``sandbox_id``."""
        desc = self.store.get_ref(ref)
        self.store.put_ref(ref, desc.digest, media_type=desc.media_type,
                           annotations={**desc.annotations, SOURCE_ANNOTATION: sandbox_id},
                           expect=desc.digest)

    def find(self, sandbox_id: str | None = None, name: str | None = None) -> list[str]:
        """The snapshot refs, in order, of sandbox ``sandbox_id`` and called ``name`` (its
        id or its NAME) where given."""
        out = []
        for ref in self.store.list_refs():
            if not ref.startswith(PREFIXES):
                continue
            if name is not None and name not in (ref, ref.split("/", 2)[2]):
                continue
            if sandbox_id is not None:
                try:
                    annotations = self.store.get_ref(ref).annotations
                except RefNotFound:  # deleted since the listing
                    continue
                if annotations.get(SOURCE_ANNOTATION) != sandbox_id:
                    continue
            out.append(ref)
        return out

    def delete(self, snapshot_id: str) -> bool:
        """Remove snapshot ``snapshot_id``'s ref; False if there is none."""
        if not snapshot_id.startswith(PREFIXES):
            raise ValueError(snapshot_id)
        try:
            self.store.get_ref(snapshot_id)
        except RefNotFound:
            return False
        self.store.delete_ref(snapshot_id)
        return True


SNAPSHOTS = web.AppKey("snapshots", Snapshots)


def _page(query: Any) -> tuple[int, int]:
    try:
        limit, offset = int(query.get("limit", MAX_PAGE)), int(query.get("nextToken", "0"))
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"bad list query: {e}") from None
    if not 0 < limit <= MAX_PAGE or offset < 0:
        raise web.HTTPBadRequest(text=f"limit is 1 to {MAX_PAGE}; nextToken as returned")
    return limit, offset


async def list_snapshots(request: web.Request) -> web.Response:
    limit, offset = _page(request.query)
    snapshots = request.app[SNAPSHOTS]
    try:
        found = await asyncio.get_running_loop().run_in_executor(
            None, snapshots.find, request.query.get("sandboxID") or None,
            request.query.get("name") or None)
    except EnvbuildError as e:
        return _error(500, f"list snapshots: {e.message}")
    end = offset + limit
    headers = {"x-next-token": str(end)} if end < len(found) else {}
    return web.json_response([{"snapshotID": ref, "names": [ref]} for ref in found[offset:end]],
                             headers=headers)


async def delete_snapshot(request: web.Request) -> web.Response:
    snapshot_id = request.match_info["template_id"]
    if not snapshot_id.startswith(PREFIXES):
        return _error(400, f"{snapshot_id[:200]} is not a snapshot: envbuild serve deletes "
                           f"snapshots only ({SNAPSHOT_PREFIX}NAME, {FS_SNAPSHOT_PREFIX}NAME); "
                           "remove other refs with envbuild's own commands")
    try:
        deleted = await asyncio.get_running_loop().run_in_executor(
            None, request.app[SNAPSHOTS].delete, snapshot_id)
    except EnvbuildError as e:
        return _error(500, f"delete snapshot {snapshot_id}: {e.message}")
    if not deleted:
        return _error(404, f"snapshot {snapshot_id} was not found")
    return web.Response(status=204)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/snapshots", list_snapshots)
    # a snapshot id holds "/": the SDK sends it %2F-encoded, and any form is one id here
    app.router.add_delete("/templates/{template_id:.+}", delete_snapshot)
