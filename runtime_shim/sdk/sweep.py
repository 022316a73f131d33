"""Removing a node's sandboxes, whoever made them: one by id (``remove_sandbox``), or every
one past its TTL or whose creating process is gone (``sweep_sandboxes``, ``gc_sandboxes``).

A removal goes through the backend the sandbox's record names (``runtime_shim.backends``), so
this sits above the backends; the records themselves are ``runtime_shim.node.records``.
"""

from __future__ import annotations

import dataclasses
import os
import time

from envbuild.errors import BackendUnavailable, RuntimeShimError, SandboxNotFound
from runtime_shim.backends.base import get_backend, remove_sandbox_dir
from runtime_shim.isolation import cgroupfs
from runtime_shim.node import admission, diskpool, ledger, owners
from runtime_shim.node.layout import NodeLayout
from runtime_shim.node.records import list_sandboxes, node_layout, read_record


def remove_sandbox(node_dir: str | os.PathLike[str] | NodeLayout | None, sandbox_id: str,
                   runtime: str = "runc") -> None:
    """Kill, unmount and delete one sandbox, whoever created it; ``SandboxNotFound`` if the
    node has no sandbox by that id."""
    layout = node_layout(node_dir)
    paths = layout.sandbox(sandbox_id)
    if not os.path.lexists(paths.root):
        raise SandboxNotFound(f"no sandbox {sandbox_id} on this host",
                              hint="envbuild sandbox ls lists them")
    meta = read_record(paths) or {}
    name = meta.get("backend", "container")
    try:
        impl = get_backend(name)
    except BackendUnavailable:
        impl = get_backend("container")  # an unknown record: at least its runc state goes
    impl.remove(layout, sandbox_id, runtime)
    if name != "container" and (layout.runc / sandbox_id).exists():  # whatever the record says
        get_backend("container").remove(layout, sandbox_id, runtime)
    remove_sandbox_dir(paths)
    ledger.Ledger(layout.node).release(admission.sandbox_key(sandbox_id))


@dataclasses.dataclass(frozen=True)
class SandboxRemoval:
    """What ``sweep_sandboxes`` did with one sandbox: removed, or ``error`` (one line: the
    cause, then the hint). ``reason`` is "orphaned" (its creator is gone), "expired", or
    "stale cgroup" (an old sandbox cgroup with no process, left by a crash)."""

    id: str
    error: str | None = None
    reason: str = "orphaned"

    @property
    def removed(self) -> bool:
        return self.error is None


def sweep_sandboxes(node_dir: str | os.PathLike[str] | NodeLayout | None = None,
                    runtime: str = "runc", *, automatic: bool = False,
                    now: float | None = None, dead_owner: int | None = None
                    ) -> list[SandboxRemoval]:
    """Try to remove every sandbox past its TTL, and every one whose creating process is gone
    (a crash or kill -9) except kept ones; one that fails never stops the others. One
    ``SandboxRemoval`` per sandbox. ``automatic`` (the sweep at each ``create``): only
    sandboxes with a readable record are considered, since a dir without one may be a create
    in progress; ``envbuild sandbox gc`` takes those too. ``dead_owner`` (a pid known to have
    died at ``now``: ``runtime_shim.sdk.exitwatch``): only the sandboxes it created before then,
    except kept ones. Each is removed with the runtime its record names, else ``runtime``. A
    full sweep also unmounts the node's disk pool if it has been empty past its grace."""
    now = time.time() if now is None else now
    started = time.time()
    done = []
    infos = list_sandboxes(node_dir)
    for info in infos:
        if automatic and info.lock == "?":
            continue
        if dead_owner is not None:
            if info.pid != dead_owner or info.created > now or info.kept:
                continue
            reason = "orphaned"
        elif info.expired(now):
            reason = "expired"
        elif info.alive or info.kept:
            continue
        else:
            reason = "orphaned"
        try:
            remove_sandbox(node_dir, info.id, info.runtime or runtime)
        except SandboxNotFound:
            continue  # another sweep got there first
        except RuntimeShimError as e:
            done.append(SandboxRemoval(info.id, e.message + (f" — {e.hint}" if e.hint else ""),
                                       reason))
        except OSError as e:
            done.append(SandboxRemoval(info.id, f"{e.strerror} ({e.filename or info.path})",
                                       reason))
        else:
            done.append(SandboxRemoval(info.id, reason=reason))
    if dead_owner is None:   # a full sweep: what is left tells the next create whether to sweep
        gone = {r.id for r in done if r.removed}
        owners.after_sweep(node_layout(node_dir), ((i.pid, i.kept, i.expires) for i in infos
                                                   if i.id not in gone), started)
        if not automatic:
            done += _sweep_stale_cgroups()
            _unmount_idle_pool(node_layout(node_dir))
    return done


def _unmount_idle_pool(layout: NodeLayout) -> None:
    """The node's disk pool, empty past its grace, whose process died in it (killed; one that
    exits unmounts its own): unmounted (``runtime_shim.node.diskpool``)."""
    diskpool.unmount_idle(layout, diskpool.grace(os.environ))


#: A sandbox cgroup younger than this may belong to a create in progress (runc makes the
#: dirs before its init joins them): ``sandbox gc`` leaves it.
STALE_CGROUP_AGE = 300.0
#: The names ``sandbox gc`` looks at under ``/envbuild`` (every sandbox id starts so).
STALE_CGROUP_PREFIX = "eb-"


def _sweep_stale_cgroups() -> list[SandboxRemoval]:
    """Remove the host's empty sandbox cgroups older than ``STALE_CGROUP_AGE`` (a runtime
    killed mid-create, a crash; a live sandbox's cgroup holds its init): left, each costs the
    kernel a cgroup in every hierarchy, and every later cpuset write walks it."""
    done = []
    for sid in cgroupfs.stale(STALE_CGROUP_AGE, STALE_CGROUP_PREFIX):
        left = cgroupfs.remove(sid, wait=0.5)
        done.append(SandboxRemoval(sid, f"could not remove {left[0]}" if left else None,
                                   "stale cgroup"))
    return done


def gc_sandboxes(node_dir: str | os.PathLike[str] | NodeLayout | None = None,
                 runtime: str = "runc") -> list[str]:
    """Remove expired sandboxes and those whose creating process is gone, except kept ones:
    the ids removed. Every one is tried; if any could not be removed, ``RuntimeShimError``
    afterwards names each with its cause (``sweep_sandboxes`` gives the outcomes instead)."""
    done = sweep_sandboxes(node_dir, runtime)
    failed = [r for r in done if not r.removed]
    if failed:
        raise RuntimeShimError(f"{len(failed)} sandbox(es) could not be removed "
                               f"({len(done) - len(failed)} removed)",
                               context="\n".join(f"{r.id}: {r.error}" for r in failed))
    return [r.id for r in done]
