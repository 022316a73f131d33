"""Where the server's sandboxes come from: ``NodeBackend``, runtime_shim sandboxes of one
node and store. Every sandbox is created ``keep=True`` (it outlives the server process, which
re-attaches it by id: ``envbuild.serve.records``) and, unless ``pausable=False``,
``checkpointable=True`` (CRIU can dump it: E2B's pause keeps memory).

A pause publishes the sandbox's checkpoint (``Sandbox.checkpoint``: files and memory) or, for
a filesystem-only pause, its pack-diff, under the ref ``PAUSED_PREFIX + <e2b id>``, so that
``envbuild gc`` keeps it while the sandbox is paused; resume and kill drop that ref.

A snapshot (E2B's ``create_snapshot``; the sandbox runs on) is published the same way under
``SNAPSHOT_PREFIX + NAME`` (files and memory: a create of that ref restores the processes) or
``FS_SNAPSHOT_PREFIX + NAME`` (files only: a create of it starts fresh from them); the ref is
the snapshot's id, which E2B's ``Sandbox.create(snapshot_id)`` takes as a template. A fork
checkpoints once (the sandbox runs on) and restores that checkpoint ``count`` times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from runtime_shim import AsyncSandbox

T = TypeVar("T")

#: The store ref of a paused sandbox's checkpoint: ``e2b/paused/<e2b id>``.
PAUSED_PREFIX = "e2b/paused/"
#: The store refs of snapshots: with memory, and of the files only.
SNAPSHOT_PREFIX = "e2b/snapshots/"
FS_SNAPSHOT_PREFIX = "e2b/fs-snapshots/"


@dataclasses.dataclass(frozen=True)
class NodeBackend:
    """Create, attach, pause and resume runtime_shim sandboxes of ``store`` on ``node_dir``."""

    store: Any  # envbuild.store.Store
    node_dir: str | os.PathLike[str]
    runtime: str = "runc"
    pausable: bool = True
    limits: Any = None  # runtime_shim.Limits of every sandbox (None: the default)

    @property
    def keeps_memory(self) -> bool:
        """Whether a pause or snapshot may keep the processes (CRIU: ``pausable``)."""
        return self.pausable

    async def create(self, template: str, network: bool | list[str] | None = None
                     ) -> AsyncSandbox:
        """A sandbox of ``template`` (or continuing snapshot ``template``) with ``network``
        (``Sandbox.set_network``'s argument; None: no network at all)."""
        if template.startswith(SNAPSHOT_PREFIX):
            return await self.resume(template, memory=True, network=network)
        return await closed_if(network, AsyncSandbox.create(
            template, store=self.store, node_dir=self.node_dir, runtime=self.runtime,
            keep=True, checkpointable=self.pausable, limits=self.limits,
            network=opened_network(network)))

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

    async def resume(self, lock: str, *, memory: bool,
                     network: bool | list[str] | None = None) -> AsyncSandbox:
        """A sandbox continuing from ``lock`` (its processes too if ``memory``), with
        ``network`` as for ``create``."""
        if memory:
            return await closed_if(network, AsyncSandbox.restore(
                lock, store=self.store, node_dir=self.node_dir, runtime=self.runtime,
                keep=True, limits=self.limits, network=opened_network(network)))
        return await self.create(lock, network)

    async def snapshot(self, sandbox: AsyncSandbox, name: str, *, memory: bool) -> str:
        """Publish ``sandbox``'s files (and memory if ``memory``) as a snapshot named
        ``name`` (a valid ref component); its id (the ref). ``sandbox`` runs on."""
        if memory:
            ref = SNAPSHOT_PREFIX + name
            await sandbox.checkpoint(ref, leave_running=True)
        else:
            ref = FS_SNAPSHOT_PREFIX + name
            await sandbox.pack_diff(ref)
        return ref

    async def fork(self, sandbox: AsyncSandbox, count: int,
                   network: bool | list[str] | None = None) -> list[AsyncSandbox | Exception]:
        """``count`` sandboxes continuing from ``sandbox`` (which runs on), each a sandbox or
        the error its restore raised; ``network`` as for ``create``."""
        lock = (await sandbox.checkpoint(None, leave_running=True)).lock
        return await each_or_error(self.resume(lock, memory=True, network=network)
                                   for _ in range(count))

    def forget(self, e2b_id: str) -> None:
        """Drop the paused ref of ``e2b_id`` (idempotent)."""
        self.store.delete_ref(PAUSED_PREFIX + e2b_id)


async def each_or_error(making: Iterable[Awaitable[T]]) -> list[T | Exception]:
    """Await every one of ``making`` at once: each its result or the ``Exception`` it raised
    (a fork's children fail alone); anything else (a cancellation) is raised."""
    out: list[T | Exception] = []
    for child in await asyncio.gather(*making, return_exceptions=True):
        if isinstance(child, BaseException) and not isinstance(child, Exception):
            raise child
        out.append(child)
    return out


def opened_network(network: bool | list[str] | None) -> bool | list[str]:
    """``create``'s ``network=`` for ``network``: a closed one (False) is made with DNS only
    (``[]``), so that it has a namespace whose rules can change later."""
    return [] if network is False else (False if network is None else network)


async def closed_if(network: bool | list[str] | None, making: Awaitable[Any]) -> Any:
    """The sandbox ``making`` gives, its firewall closed (not even DNS) if ``network`` is
    False, before anything but its agent has run in it."""
    sandbox = await making
    if network is False:
        try:
            await sandbox.set_network(False)
        except BaseException:
            await sandbox.close()
            raise
    return sandbox
