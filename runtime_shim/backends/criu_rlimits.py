"""Why CRIU cannot dump a non-root process where root lacks ``CAP_SYS_RESOURCE``, in one line.

CRIU reads each task's rlimits with ``prlimit(pid, …)``, and the kernel allows that
of another task only to a caller whose uid and gid match all of the task's (real, effective,
saved) or that holds ``CAP_SYS_RESOURCE`` in the task's user namespace. Root that lacks the
capability (a host or container whose bounding set drops it) can read the rlimits of root's
processes only, so CRIU stops with "Can't get rlimit 0: Operation not permitted" at the first
process of another user. ``refusal`` turns that into a ``CheckpointRefused`` naming the
process, its user and the missing capability.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from envbuild.errors import CheckpointRefused

#: The capability's bit in ``/proc/<pid>/status``' ``Cap*`` masks.
CAP_SYS_RESOURCE = 24
_CRIU_SAYS = "Can't get rlimit"


def has_cap_sys_resource() -> bool:
    """Whether this process (and so the CRIU it starts) holds ``CAP_SYS_RESOURCE``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


def _ids(host_pid: int) -> tuple[list[int], list[int]]:
    """The (real, effective, saved, fs) uids and gids of ``host_pid``."""
    found: dict[str, list[int]] = {}
    with open(f"/proc/{host_pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Uid", "Gid"):
                found[key] = [int(v) for v in value.split()]
    return found.get("Uid", []), found.get("Gid", [])


def refusal(what: str, errors: Sequence[str],
            processes: Callable[[], list[dict[str, Any]]]) -> CheckpointRefused | None:
    """The one-line refusal of a dump that failed on a task's rlimits for want of
    ``CAP_SYS_RESOURCE`` (``processes``: ``criu._processes`` of the sandbox, read now: the
    sandbox runs on), or None if that is not why it failed."""
    said = next((e for e in errors if e.startswith(_CRIU_SAYS)), None)
    if said is None or has_cap_sys_resource():
        return None
    who = "a process of another user than root"
    for p in processes():
        try:
            uids, gids = _ids(p["host_pid"])
        except OSError:  # it exited meanwhile
            continue
        if any(uids[:3]) or any(gids[:3]):
            who = f"process {p['pid']} {p['comm']} runs as uid {uids[0]} (gid {gids[0]})"
            break
    return CheckpointRefused(
        f"{what}: {who}, and this host's root lacks CAP_SYS_RESOURCE, without which the "
        f"kernel refuses CRIU its rlimits (CRIU: {said})",
        context="\n".join(errors[:10]),
        hint="run the node with CAP_SYS_RESOURCE in root's bounding set (a container: "
             "--cap-add SYS_RESOURCE), run the sandbox's processes as root, or save the files "
             "only (pack_diff; E2B: pause(mode='filesystem')); the sandbox runs on")
