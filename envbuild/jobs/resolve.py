"""``envbuild job resolve``: pin every group's lock to a digest and record its closure.

For each group: a ref (``env/NAME``, ``snap/NAME``, a bare env name — ``envbuild.store.sync
.resolve_ref`` decides, as ``push`` does) becomes the digest it points at now; the lock is read
(``runtime_shim.node.locks.resolve``: it must be a runnable image manifest of ``tar+zstd`` layers)
and its closure enumerated (``envbuild.store.sync.walk``); every blob of the closure must be in
the store. The group then records ``pinned: {ref, config, layers: [{digest, size, toc}]}``.
A group naming a ``task`` (a task name, ``task/NAME`` or digest) gets the task lock's digest
as ``task`` and its env lock as ``lock`` (``runtime_shim.node.load_task``), ``pinned.ref``
the task's ref.

A group that is already resolved must resolve to itself: its lock is a digest, so its closure
cannot change, and a ``pinned`` that disagrees with the lock means the file was edited — an
error, not a silent rewrite. Every group's problems are collected before raising one
``StoreError`` (reference ``job-unresolvable``).
"""

from __future__ import annotations

import dataclasses

from envbuild.errors import EnvbuildError, StoreError
from envbuild.jobs.model import JobManifest, Pinned, PinnedLayer, SandboxGroup
from envbuild.oci import MEDIA_TYPE_MANIFEST, is_digest
from envbuild.store import Store
from envbuild.store.sync import resolve_ref, walk
from runtime_shim.node import TASK_REF_PREFIX, load_task, resolve


def resolve_job_manifest(manifest: JobManifest, store: Store) -> JobManifest:
    """``manifest`` with every group pinned against ``store``; see the module docstring."""
    groups: list[SandboxGroup] = []
    problems: list[str] = []
    for group in manifest.groups:
        try:
            groups.append(resolve_group(group, store))
        except EnvbuildError as e:
            problems.append(f"group {group.label}: {e.message}")
    if problems:
        raise StoreError(f"cannot resolve {len(problems)} of {len(manifest.groups)} group(s)",
                         reference="job-unresolvable", context="\n".join(problems),
                         hint="build or pull the missing locks and layers "
                              "(envbuild build / envbuild pull), then resolve again")
    return dataclasses.replace(manifest, groups=tuple(groups))


def resolve_group(group: SandboxGroup, store: Store) -> SandboxGroup:
    """One group pinned; raises the first problem (an ``EnvbuildError``)."""
    task_ref = None
    if group.task:
        group, task_ref = _task_group(group, store)
    if is_digest(group.lock):
        digest, ref = group.lock, group.pinned.ref if group.pinned else None
    else:
        ref = resolve_ref(store, group.lock)
        digest = store.get_ref(ref).digest
    lock = resolve(store, digest)
    if lock.digest != digest and not group.task:  # ``lock`` named a task lock: a task group
        return resolve_group(dataclasses.replace(group, task=ref or digest, lock=""), store)
    blobs, _keys = walk(store, {"mediaType": MEDIA_TYPE_MANIFEST, "digest": digest})
    missing = [d for d, _ in blobs if not store.exists(d)]
    if missing:
        raise StoreError(f"lock {digest} lacks {len(missing)} blob(s) in the store: "
                         + ", ".join(missing))
    no_toc = [layer.digest for layer in lock.layers if not is_digest(layer.toc_digest)]
    if no_toc:
        raise StoreError(f"lock {digest}: layer(s) without a TOC digest annotation: "
                         + ", ".join(no_toc))
    pinned = Pinned(ref=task_ref or ref, config=lock.manifest["config"]["digest"],
                    layers=tuple(PinnedLayer(layer.digest, layer.size, layer.toc_digest)
                                 for layer in lock.layers))
    if group.pinned is not None and dataclasses.replace(group.pinned, ref=ref) != pinned:
        raise StoreError(f"the pinned config and layers do not match lock {digest}",
                         hint="the resolved manifest was edited; restore it or resolve the "
                              "original manifest again")
    return dataclasses.replace(group, lock=digest, pinned=pinned)


def _task_group(group: SandboxGroup, store: Store) -> tuple[SandboxGroup, str | None]:
    """A group naming a task: its ``task`` the task lock's digest, its ``lock`` the task's env
    lock (a ``lock`` it already names must be that one); and the task ref it came from."""
    assert group.task is not None
    task = load_task(store, group.task)
    lock = group.lock
    if lock and not is_digest(lock):
        lock = store.get_ref(resolve_ref(store, lock)).digest
    if lock and lock != task.spec.env_lock:
        raise StoreError(f"lock {group.lock} is not the env lock of task lock {task.digest} "
                         f"({task.spec.env_lock})",
                         hint="name the task alone: its sandboxes get the task's env lock")
    ref = None if is_digest(group.task) else TASK_REF_PREFIX + group.task.removeprefix(
        TASK_REF_PREFIX)
    if ref is None and group.pinned is not None:
        ref = group.pinned.ref
    return dataclasses.replace(group, task=task.digest, lock=task.spec.env_lock), ref
