"""Where the server's sandboxes come from: ``NodeBackend``, runtime_shim sandboxes of one
node and store. Every sandbox is created ``keep=True`` (it outlives the server process, which
re-attaches it by id: ``envbuild.serve.records``) and, unless ``pausable=False``,
``checkpointable=True`` (CRIU can dump it: E2B's pause keeps memory).

A pause publishes the sandbox's checkpoint (``Sandbox.checkpoint``: files and memory) or, for
a filesystem-only pause, its pack-diff, under the ref ``PAUSED_PREFIX + <e2b id>``, so that
``envbuild gc`` keeps it while the sandbox is paused; resume and kill drop that ref.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from runtime_shim import AsyncSandbox

#: The store ref of a paused sandbox's checkpoint: ``e2b/paused/<e2b id>``.
PAUSED_PREFIX = "e2b/paused/"


@dataclasses.dataclass(frozen=True)
class NodeBackend:
    """Create, attach, pause and resume runtime_shim sandboxes of ``store`` on ``node_dir``."""

    store: Any  # envbuild.store.Store
    node_dir: str | os.PathLike[str]
    runtime: str = "runc"
    pausable: bool = True

    async def create(self, template: str) -> AsyncSandbox:
        return await AsyncSandbox.create(template, store=self.store, node_dir=self.node_dir,
                                         runtime=self.runtime, keep=True,
                                         checkpointable=self.pausable)

    async def attach(self, sandbox_id: str) -> AsyncSandbox:
        return await AsyncSandbox.attach(sandbox_id, store=self.store, node_dir=self.node_dir,
                                         runtime=self.runtime)

    async def pause(self, sandbox: AsyncSandbox, e2b_id: str, *, memory: bool) -> str:
        """Save ``sandbox`` under its paused ref and close it; the lock saved."""
        ref = PAUSED_PREFIX + e2b_id
        if memory:
            return (await sandbox.checkpoint(ref, leave_running=False)).lock
        made = await sandbox.pack_diff(ref)
        await sandbox.close()
        return made.lock

    async def resume(self, lock: str, *, memory: bool) -> AsyncSandbox:
        """A sandbox continuing from ``lock`` (its processes too if ``memory``)."""
        if memory:
            return await AsyncSandbox.restore(lock, store=self.store, node_dir=self.node_dir,
                                              runtime=self.runtime, keep=True)
        return await self.create(lock)

    def forget(self, e2b_id: str) -> None:
        """Drop the paused ref of ``e2b_id`` (idempotent)."""
        self.store.delete_ref(PAUSED_PREFIX + e2b_id)
