"""Memory given back by idle container sandboxes (issue 19 item 2, the container half), and
what each sandbox holds (``Sandbox.info().memory``).

What this host supports, found by trying: the memory controller is cgroup **v1** (the hybrid
layout; the cgroup2 mount at ``/sys/fs/cgroup/unified`` has no controllers), so cgroup v2's
``memory.reclaim`` (proactive reclaim of a given amount) does not exist here; v1's
``memory.force_empty`` does, and on a cgroup with live tasks it reclaims every page the kernel
can take from it (measured: 105 MB of page cache from a live sandbox in ~0.3 s), then returns.
There is no swap on these machines, so what any reclaim can take back is the page cache and
reclaimable kernel memory charged to the sandbox (files it wrote or read, layer pages it
faulted first), never anonymous memory, which the kernel gets back anyway when a process frees
it (``munmap``/exit). Where the controller is v2, ``memory.reclaim`` is written with the
sandbox's current usage, which asks for the same.

The policy (``ReclaimPolicy``, one per node: ``<node dir>/reclaim-policy.json`` or passed in)
decides which sandboxes are idle: a sandbox is reclaimed when it used less than
``idle_cpu_fraction`` of one CPU since the previous pass, which was at least ``idle_seconds``
ago, and holds at least ``min_bytes``. ``reclaim_idle`` is one pass over a node's live
container and FnCall sandboxes; run it from a timer (``Reclaimer`` is a thread that does).
Per-sandbox state (the CPU time at the last pass, bytes reclaimed so far) is in
``<sandbox dir>/reclaim.json`` (versioned), removed with the sandbox.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envbuild.atomic import write_atomic
from envbuild.errors import RuntimeShimError
from runtime_shim.isolation import cgroupfs
from runtime_shim.node.layout import NodeLayout, SandboxPaths
from runtime_shim.node.model import MemoryInfo

STATE_VERSION = 1
STATE_FILE = "reclaim.json"
POLICY_FILE = "reclaim-policy.json"
POLICY_VERSION = 1
#: Backends whose sandboxes are cgroups of this host.
CGROUP_BACKENDS = ("container", "fncall")


@dataclasses.dataclass(frozen=True)
class ReclaimPolicy:
    """When a node takes memory back from its sandboxes (see the module docstring)."""

    idle_seconds: float = 60.0
    idle_cpu_fraction: float = 0.01
    min_bytes: int = 16 << 20

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ReclaimPolicy:
        if data.get("version") != POLICY_VERSION:
            raise RuntimeShimError(f"reclaim policy version {data.get('version')!r} is not "
                                   f"known (this envbuild reads {POLICY_VERSION})")
        try:
            return cls(idle_seconds=float(data.get("idle_seconds", cls.idle_seconds)),
                       idle_cpu_fraction=float(data.get("idle_cpu_fraction",
                                                        cls.idle_cpu_fraction)),
                       min_bytes=int(data.get("min_bytes", cls.min_bytes)))
        except (TypeError, ValueError) as e:
            raise RuntimeShimError(f"bad reclaim policy: {e}") from None

    @classmethod
    def for_node(cls, layout: NodeLayout) -> ReclaimPolicy:
        """The node's policy file, or the defaults."""
        path = layout.root / POLICY_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as e:
            raise RuntimeShimError(f"read {path}: {e}") from None
        return cls.from_mapping(data)


@dataclasses.dataclass(frozen=True)
class ReclaimResult:
    id: str
    before: int  # the cgroup's usage, bytes
    after: int
    seconds: float

    @property
    def freed(self) -> int:
        return max(0, self.before - self.after)


def _memory_dir(sandbox_id: str) -> tuple[Path, int] | None:
    return cgroupfs.controller_dir("memory", sandbox_id)


def _stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (path / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.isdigit():
            out[key] = int(value)
    return out


def usage(sandbox_id: str) -> int | None:
    found = _memory_dir(sandbox_id)
    if found is None:
        return None
    path, version = found
    return int((path / ("memory.usage_in_bytes" if version == 1 else "memory.current"))
               .read_text())


def memory_info(paths: SandboxPaths) -> MemoryInfo | None:
    """What the sandbox holds now (None when it has no memory cgroup: not running, or not a
    cgroup of this host)."""
    found = _memory_dir(paths.id)
    if found is None:
        return None
    path, version = found
    try:
        s = _stat(path)
        now = usage(paths.id) or 0
    except OSError:
        return None
    if version == 1:
        rss, cache = s.get("total_rss", 0), s.get("total_cache", 0)
        shared = s.get("total_mapped_file", 0) + s.get("total_shmem", 0)
    else:
        rss, cache = s.get("anon", 0), s.get("file", 0)
        shared = s.get("file_mapped", 0) + s.get("shmem", 0)
    return MemoryInfo(rss=rss, cache=cache, shared=shared, usage=now,
                      reclaimed=int(_read_state(paths).get("reclaimed", 0)))


def reclaim(paths: SandboxPaths) -> ReclaimResult:
    """Take back what the kernel can of the sandbox's memory now (see the module docstring),
    and add it to the sandbox's ``reclaimed`` figure."""
    found = _memory_dir(paths.id)
    if found is None:
        raise RuntimeShimError(f"sandbox {paths.id} has no memory cgroup",
                               hint="is it running, on the container or fncall backend?")
    path, version = found
    started = time.monotonic()
    before = usage(paths.id) or 0
    try:
        if version == 1:
            (path / "memory.force_empty").write_text("0")
        elif before:
            (path / "memory.reclaim").write_text(str(before))
    except OSError as e:
        # v2 says EAGAIN when it could not reclaim all it was asked for: what it got counts
        if e.errno not in (11,):
            raise RuntimeShimError(f"reclaim memory of sandbox {paths.id}: {e.strerror}") from e
    after = usage(paths.id) or 0
    result = ReclaimResult(paths.id, before, after, time.monotonic() - started)
    state = _read_state(paths)
    state["reclaimed"] = int(state.get("reclaimed", 0)) + result.freed
    _write_state(paths, state)
    return result


def parse_cpu_ns(text: str, name: str) -> int | None:  # pure
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


def reclaim_idle(node_dir: str | os.PathLike[str] | NodeLayout, policy: ReclaimPolicy | None
                 = None, *, now: float | None = None) -> list[ReclaimResult]:
    """One pass of the node's policy over its live container and FnCall sandboxes: reclaim
    each idle one (module docstring). A sandbox seen for the first time is only recorded."""
    from runtime_shim.node.records import list_sandboxes

    layout = node_dir if isinstance(node_dir, NodeLayout) else NodeLayout(node_dir)
    policy = policy or ReclaimPolicy.for_node(layout)
    now = time.time() if now is None else now
    done = []
    for info in list_sandboxes(layout):
        if info.backend not in CGROUP_BACKENDS or not info.ready:
            continue
        paths = SandboxPaths(info.path)
        try:
            cpu, held = cpu_ns(info.id), usage(info.id)
            if cpu is None or held is None:
                continue
            state = _read_state(paths)
            last_cpu, last_seen = state.get("cpu_ns"), state.get("checked")
            if isinstance(last_cpu, int) and isinstance(last_seen, (int, float)):
                elapsed = now - last_seen
                if elapsed < policy.idle_seconds:
                    continue  # the window is not over yet
                used = (cpu - last_cpu) / 1e9
                if used <= policy.idle_cpu_fraction * elapsed and held >= policy.min_bytes:
                    done.append(reclaim(paths))
                    state = _read_state(paths)
            state.update(cpu_ns=cpu, checked=now)
            _write_state(paths, state)
        except (OSError, RuntimeShimError):
            continue  # closed meanwhile: nothing to give back
    return done


class Reclaimer:
    """A daemon thread running ``reclaim_idle`` on a node every ``interval`` seconds until
    ``stop``. Failures of one pass are kept in ``errors`` (the last 10) and never stop it."""

    def __init__(self, node_dir: str | os.PathLike[str] | NodeLayout,
                 policy: ReclaimPolicy | None = None, interval: float = 10.0) -> None:
        self.node_dir, self.policy, self.interval = node_dir, policy, interval
        self.errors: list[str] = []
        self.reclaimed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="envbuild-reclaim",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.reclaimed += sum(r.freed for r in reclaim_idle(self.node_dir, self.policy))
            except Exception as e:  # the next pass tries again
                self.errors = [*self.errors[-9:], str(e)]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _read_state(paths: SandboxPaths) -> dict[str, Any]:
    try:
        data = json.loads((paths.root / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {"version": STATE_VERSION}
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        return {"version": STATE_VERSION}  # unknown versions start over: it is a cache
    return data


def _write_state(paths: SandboxPaths, state: dict[str, Any]) -> None:
    write_atomic(paths.root / STATE_FILE, json.dumps({**state, "version": STATE_VERSION}))
