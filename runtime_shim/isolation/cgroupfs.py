"""Where a sandbox's cgroup is, per controller, on this host's cgroup layout (side effects:
reads ``/proc/self/mountinfo``).

runc puts a sandbox's cgroup at ``cgroupsPath`` (``/envbuild/<id>``) in every hierarchy it
drives: on a hybrid host (this one: cgroup v1 controllers under ``/sys/fs/cgroup/<name>``, a
controller-less cgroup2 at ``/sys/fs/cgroup/unified``) that is one dir per v1 controller; on a
pure cgroup v2 host one dir in the unified tree holding every controller's files.
"""

from __future__ import annotations

import functools
import io
import os
import signal
import time
from pathlib import Path

#: The parent of every sandbox's and build step's cgroup (``RuntimeSpecRequest.cgroups_path``).
PARENT = "envbuild"


@functools.lru_cache(maxsize=1)
def _mounts() -> tuple[dict[str, str], str | None]:
    """(v1 controller → mount point, cgroup2 mount point or None)."""
    v1: dict[str, str] = {}
    v2 = None
    # io.open: the builtin is gone late at interpreter exit, where a sandbox may still close
    with io.open("/proc/self/mountinfo", encoding="utf-8",  # noqa: UP020
                 errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if not rfields:
                continue
            point = fields[4]
            if rfields[0] == "cgroup2":
                v2 = v2 or point
            elif rfields[0] == "cgroup":
                for opt in rfields[2].split(","):
                    v1.setdefault(opt, point)
    return v1, v2


def controller_dir(controller: str, sandbox_id: str) -> tuple[Path, int] | None:
    """The cgroup dir of ``sandbox_id`` for ``controller`` and its version (1 or 2), or None
    when the host has that controller nowhere (or the dir does not exist)."""
    v1, v2 = _mounts()
    if controller in v1:
        path, version = Path(v1[controller]) / PARENT / sandbox_id, 1
    elif v2 is not None and controller in _v2_controllers(v2):
        path, version = Path(v2) / PARENT / sandbox_id, 2
    else:
        return None
    return (path, version) if path.is_dir() else None


def cloning_cpuset_parent() -> None:
    """Make ``/envbuild`` in the v1 cpuset hierarchy a cloning parent before a sandbox is made
    (``cgroup.clone_children=1``, its cpus and mems set): a child then starts with the parent's
    cpus and mems, so runc (which copies them only into an empty cpuset) writes no
    ``cpuset.cpus``. That write rebuilds the scheduler domains, walking every cpuset on the
    host: 0.76 → 3.28 ms per create from 100 to 1,000 live sandboxes, against a flat ~0.17 ms
    cloned (docs/density-profile.md). One read once the parent is ready; no-op without a v1
    cpuset hierarchy (cgroup v2 has no such write)."""
    v1, _ = _mounts()
    if "cpuset" not in v1:
        return
    root = Path(v1["cpuset"])
    parent = root / PARENT
    try:
        if (parent / "cgroup.clone_children").read_text().strip() == "1":
            return
    except FileNotFoundError:
        pass
    parent.mkdir(exist_ok=True)
    for name in ("cpuset.cpus", "cpuset.mems"):
        if not (parent / name).read_text().strip():
            (parent / name).write_text((root / name).read_text())
    (parent / "cgroup.clone_children").write_text("1")


def _v2_controllers(root: str) -> set[str]:
    try:
        return set(Path(root, "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def procs(sandbox_id: str) -> list[int]:
    """Every process of the sandbox (its ``pids`` cgroup, else the freezer's)."""
    for controller in ("pids", "freezer", "memory"):
        found = controller_dir(controller, sandbox_id)
        if found is not None:
            text = (found[0] / "cgroup.procs").read_text()
            return [int(p) for p in text.split()]
    raise FileNotFoundError(f"no cgroup of sandbox {sandbox_id}")


def exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def dirs(sandbox_id: str) -> list[Path]:
    """Every cgroup dir ``sandbox_id`` has on this host (one per hierarchy it is in)."""
    return sorted(p for p in (m / PARENT / sandbox_id for m in hierarchies()) if p.is_dir())


def hierarchies() -> list[Path]:
    """The mount point of every cgroup hierarchy on this host (each v1 one, the cgroup2 one)."""
    v1, v2 = _mounts()
    return sorted(Path(m) for m in set(v1.values()) | ({v2} if v2 else set()))


def stale(min_age: float, prefix: str) -> list[str]:
    """Ids of sandbox cgroups (``/envbuild/<prefix>…``) with no process in any hierarchy, each
    dir made more than ``min_age`` seconds ago: what a runtime killed mid-create or a host
    crash leaves. Young ones are skipped, since a create in progress holds an empty cgroup
    until its init joins. Reads every sandbox cgroup of the host: for ``sandbox gc``, never
    the create path."""
    found: dict[str, list[Path]] = {}
    for point in hierarchies():
        try:
            names = os.listdir(point / PARENT)
        except OSError:
            continue
        for name in names:
            if name.startswith(prefix):
                found.setdefault(name, []).append(point / PARENT / name)
    cutoff = time.time() - min_age
    return sorted(sid for sid, paths in found.items() if _idle_since(paths, cutoff))


def _idle_since(paths: list[Path], cutoff: float) -> bool:
    """Every dir in ``paths`` holds no process and was made before ``cutoff``."""
    try:
        return all(p.stat().st_ctime < cutoff and not (p / "cgroup.procs").read_text().strip()
                   for p in paths)
    except OSError:   # gone meanwhile, or not a cgroup dir
        return False


def remove(sandbox_id: str, wait: float = 2.0) -> list[str]:
    """Remove ``sandbox_id``'s cgroup dirs, SIGKILLing what still runs in them; what could not
    be removed within ``wait`` seconds (empty: all gone). For a runtime killed mid-create: it
    made the dirs but no state, so its ``delete`` knows no container and leaves them (the
    soak found them after SIGKILLs of runc)."""
    if not sandbox_id or "/" in sandbox_id or sandbox_id in (".", ".."):
        raise ValueError(f"not a sandbox id: {sandbox_id!r}")
    deadline = time.monotonic() + wait
    left = dirs(sandbox_id)
    while left:
        for d in left:
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:   # EBUSY: a killed process not reaped yet
                pass
        left = [d for d in left if d.is_dir()]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return [str(d) for d in left]
