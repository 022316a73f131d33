"""What a container or FnCall sandbox uses now (``Sandbox.usage()``): CPU time, memory,
processes from its cgroups, disk from its disk (side effects: reads cgroup and sysfs files).

Where each figure comes from (``runtime_shim.isolation.cgroupfs`` finds the cgroup dirs, v1
or v2):

- CPU: ``cpuacct.usage`` (v1, ns) or ``cpu.stat``'s ``usage_usec`` (v2): the CPU time every
  process of the sandbox used since it started; ``cpus`` is its limit (``Limits.cpus``);
- memory: ``memory.usage_in_bytes`` / ``memory.current`` (page cache included) and its limit
  ``memory.limit_in_bytes`` / ``memory.max``;
- processes: ``pids.current`` and ``pids.max``;
- disk: a sandbox of the node's disk pool (``runtime_shim.node.diskpool``) reports its btrfs
  quota group (``runtime_shim.isolation.quotafs.group_usage``: data and metadata it holds,
  its cap); one with a loop disk (``scratchfs``) its filesystem's used blocks and size; one
  without a disk cap reports none.

A limit the kernel reports as unlimited (``max``, or v1's page-rounded ``LLONG_MAX``) is
None. The parsers (``parse_*``) are pure.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from runtime_shim.isolation import cgroupfs
from runtime_shim.node.layout import SandboxPaths
from runtime_shim.node.model import SandboxUsage

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


def parse_cpu_ns(text: str, name: str) -> int | None:
    """``cpuacct.usage`` (ns) or ``cpu.stat`` (its ``usage_usec`` line) → nanoseconds."""
    if name == "cpuacct.usage":
        return int(text.strip())
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) * 1000
    return None


def cpu_ns(sandbox_id: str) -> int | None:
    """The CPU time the sandbox's processes used (ns); None without a CPU cgroup."""
    for controller, name in (("cpuacct", "cpuacct.usage"), ("cpu", "cpu.stat")):
        found = cgroupfs.controller_dir(controller, sandbox_id)
        if found is not None:
            ns = parse_cpu_ns((found[0] / name).read_text(), name)
            if ns is not None:
                return ns
    return None


def _read(controller: str, sandbox_id: str, v1: str, v2: str) -> tuple[str, str] | None:
    """(current, limit) file texts of ``controller`` (v1 or v2 names), None without it."""
    found = cgroupfs.controller_dir(controller, sandbox_id)
    if found is None:
        return None
    path, version = found
    now = path / (v1 if version == 1 else v2)
    limit = {"memory.usage_in_bytes": "memory.limit_in_bytes", "memory.current": "memory.max",
             "pids.current": "pids.max"}[now.name]
    return now.read_text(), (path / limit).read_text()


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
        cpu = cpu_ns(paths.id)
        memory = _read("memory", paths.id, "memory.usage_in_bytes", "memory.current")
        pids = _read("pids", paths.id, "pids.current", "pids.current")
        if cpu is None or memory is None:
            return None
        disk, disk_limit = disk_usage(paths)
    except FileNotFoundError:  # it stopped while being read
        return None
    return SandboxUsage(
        at=time.time(), cpu_seconds=cpu / 1e9, cpus=cpus,
        memory_bytes=int(memory[0]), memory_limit=parse_limit(memory[1]),
        pids=int(pids[0]) if pids else None, pids_limit=parse_limit(pids[1]) if pids else None,
        disk_bytes=disk, disk_limit=disk_limit)
