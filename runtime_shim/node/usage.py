"""What a container or FnCall sandbox uses now (``Sandbox.usage()``): CPU time, memory,
processes from its cgroups, disk from its disk (side effects: reads cgroup and sysfs files).

Where each figure comes from (``runtime_shim.isolation.cgroupfs`` finds the cgroup dirs, v1
or v2):

- CPU: ``cpuacct.usage`` (v1, ns) or ``cpu.stat``'s ``usage_usec`` (v2): the CPU time every
  process of the sandbox used since it started (``runtime_shim.node.reclaim.cpu_ns``);
  ``cpus`` is its limit (``Limits.cpus``);
- memory: ``memory.usage_in_bytes`` / ``memory.current`` (page cache included), the page
  cache apart (``reclaim.memory_info``), and its limit ``memory.limit_in_bytes`` /
  ``memory.max``;
- processes: ``pids.current`` and ``pids.max``;
- disk: a sandbox of the node's disk pool (``runtime_shim.node.diskpool``) reports its btrfs
  quota group (``runtime_shim.isolation.quotafs.group_usage``: data and metadata it holds,
  its cap); one with a loop disk (``scratchfs``) its filesystem's used blocks and size; one
  without a disk cap reports none.

A limit the kernel reports as unlimited (``max``, or v1's page-rounded ``LLONG_MAX``) is
None. ``parse_limit`` is pure.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from runtime_shim.isolation import cgroupfs
from runtime_shim.node.layout import SandboxPaths
from runtime_shim.node.model import SandboxUsage
from runtime_shim.node.reclaim import cpu_ns, memory_info

#: cgroup v1 writes "no limit" as LLONG_MAX rounded down to a page; anything this large is it.
_UNLIMITED = 1 << 62


def parse_limit(text: str) -> int | None:
    """A cgroup limit file (``memory.max``, ``memory.limit_in_bytes``, ``pids.max``) → bytes
    or a count; None for no limit."""
    value = text.strip()
    if value == "max":
        return None
    n = int(value)
    return None if n >= _UNLIMITED else n


def _limit(controller: str, sandbox_id: str, v1: str, v2: str) -> int | None:
    """The limit file ``v1`` / ``v2`` of the sandbox's ``controller`` (None: no limit)."""
    found = cgroupfs.controller_dir(controller, sandbox_id)
    if found is None:
        return None
    return parse_limit((found[0] / (v1 if found[1] == 1 else v2)).read_text())


def _pids(sandbox_id: str) -> int | None:
    found = cgroupfs.controller_dir("pids", sandbox_id)
    return int((found[0] / "pids.current").read_text()) if found is not None else None


def disk_usage(paths: SandboxPaths) -> tuple[int | None, int | None]:
    """(bytes held, cap) of the sandbox's disk; (None, None) without one."""
    from runtime_shim.isolation import quotafs

    disk = paths.disk
    if disk.is_symlink():  # a subvolume of the disk pool
        return quotafs.group_usage(Path(os.readlink(disk)))
    if not os.path.ismount(disk):
        return None, None
    st = os.statvfs(disk)
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize


def read_usage(paths: SandboxPaths, cpus: float | None) -> SandboxUsage | None:
    """What the sandbox at ``paths`` uses now (module docstring); None when it has no cgroup
    (not running). ``cpus``: its CPU limit, as reported."""
    try:
        cpu, memory = cpu_ns(paths.id), memory_info(paths)
        if cpu is None or memory is None:
            return None
        disk, disk_limit = disk_usage(paths)
        return SandboxUsage(
            at=time.time(), cpu_seconds=cpu / 1e9, cpus=cpus, memory_bytes=memory.usage,
            memory_cache=memory.cache,
            memory_limit=_limit("memory", paths.id, "memory.limit_in_bytes", "memory.max"),
            pids=_pids(paths.id), pids_limit=_limit("pids", paths.id, "pids.max", "pids.max"),
            disk_bytes=disk, disk_limit=disk_limit)
    except FileNotFoundError:  # it stopped while being read
        return None
