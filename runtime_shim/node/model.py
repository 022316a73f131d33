"""The SDK's value types: ``Limits`` (what a sandbox may use), ``ExecResult`` (what a command
did) and ``SandboxInfo`` (what a sandbox is). Plain frozen dataclasses, no behaviour, imported by
``runtime_shim.sdk.sandbox`` and every backend alike (so no backend imports the ``Sandbox`` module);
``check_timed_out`` is the one ``ExecTimeout`` of a timed-out result, wherever the result came from.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from envbuild.errors import ExecTimeout
from runtime_shim.isolation import agent

DEFAULT_OUTPUT_CAP = 16 << 20
#: The default ``Limits.cpus``: ``DEFAULT_CPU_SHARE`` of the host's cores, within these bounds.
DEFAULT_CPU_SHARE = 0.5
MIN_DEFAULT_CPUS = 0.5
MAX_DEFAULT_CPUS = 2.0


def default_cpus(host_cores: int | None = None) -> float:
    """The default CPU limit of a sandbox on a host of ``host_cores`` (None: the cores this
    process may run on): ``DEFAULT_CPU_SHARE`` of them, clamped to
    [``MIN_DEFAULT_CPUS``, ``MAX_DEFAULT_CPUS``]."""
    cores = host_cores if host_cores is not None else len(os.sched_getaffinity(0))
    return min(MAX_DEFAULT_CPUS, max(MIN_DEFAULT_CPUS, cores * DEFAULT_CPU_SHARE))


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. ``None`` leaves a limit off.

    ``cpus``: CPU bandwidth in cores (the cgroup's CFS quota per 100 ms period; 0.5 = half a
    core). The default is a share of the host: half of the cores this process may run on, at
    least ``MIN_DEFAULT_CPUS`` and at most ``MAX_DEFAULT_CPUS`` (``default_cpus``), so one busy
    sandbox never takes a small host's every core (1.0 on a 2-core host) nor a big one's; not
    applied to microVMs, whose CPUs are their vCPUs.

    ``pids`` × ``nofile`` is the most open files a sandbox's processes can hold; no cgroup
    bounds it, so the node overcommits the host's file table as it does memory: it admits
    sandboxes while the sum of their worst cases divided by ``ENVBUILD_FILES_OVERCOMMIT`` (64
    by default, 1 for the strict worst case) fits its budget of the table, and while what the
    whole host really has open (``fs.file-nr``) does too (``runtime_shim.node.admission``; also
    tasks and disk). The defaults (256 × 1024: 4,096 charged) are a 2 GiB sandbox's share of
    a file table the kernel sizes by RAM (``fs.file-max`` ≈ RAM / 10 KiB).
    ``pids=None`` or ``memory_bytes=None`` is refused by admission for container and FnCall
    sandboxes (their host tables and kernel memory would be unbounded).

    ``disk_bytes`` / ``inodes`` cap everything the sandbox writes to host disk (its writable
    layer, ``/tmp`` and the agent's log): a subvolume of the node's btrfs disk pool capped by
    a quota group, past which writes fail with ``EDQUOT`` (``inodes`` does not apply: each
    file's metadata counts in its bytes), or with ``ENVBUILD_SANDBOX_DISK=loop`` one ext4 per
    sandbox on a loop device, ``ENOSPC`` past either limit (``runtime_shim.node.diskpool``).
    Both are sparse: they cost the host what the sandbox wrote, never more than ``disk_bytes``. With
    ``disk_bytes=None`` those dirs are plain dirs under the node dir, uncapped. The microVM
    backend sizes its writable disk from the same two fields.

    ``inotify``: allow the sandbox inotify (file-change watches; off by default: its calls
    answer ``ENOSYS``, as on a kernel without it, and most watchers poll instead). Off because
    inotify instances and watches are counted per uid (``fs.inotify.max_user_instances``, 128
    by default), the sandbox's root is the host's uid 0, and no cgroup bounds them: a sandbox
    allowed inotify can exhaust the host root's. Containers only (a microVM's guest kernel has
    its own; FnCall refuses it).

    ``cpu_class``: ``"latency"`` (the default) or ``"best-effort"``: ``SCHED_IDLE`` and the
    minimum CPU weight, so latency-class sandboxes keep their tail latency
    (``runtime_shim.isolation.cpuclass``; containers and FnCall)."""

    pids: int | None = 256
    memory_bytes: int | None = 2 << 30
    nofile: int = 1024
    cpus: float | None = dataclasses.field(default_factory=default_cpus)
    output_bytes: int = DEFAULT_OUTPUT_CAP  # per exec and stream
    exec_timeout: float = agent.DEFAULT_EXEC_TIMEOUT  # seconds, for an exec with timeout=None
    disk_bytes: int | None = 10 << 30
    inodes: int | None = 1_000_000
    cpu_class: str = "latency"
    inotify: bool = False


@dataclasses.dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration: float
    timed_out: bool = False
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def check_timed_out(result: ExecResult, sandbox_id: str) -> ExecResult:
    """``result`` if its command finished; ``ExecTimeout`` (carrying it) if it timed out: what
    an exec with ``check_timeout=True`` raises, by the SDK and the fleet's data plane alike."""
    if result.timed_out:
        raise ExecTimeout(f"command in sandbox {sandbox_id} timed out after "
                          f"{result.duration:.1f} s", result=result,
                          hint="pass a larger timeout=, or check_timeout=False to get the "
                               "result with timed_out set")
    return result


@dataclasses.dataclass(frozen=True)
class MemoryInfo:
    """What one sandbox holds of the host's memory, in bytes (its memory cgroup's
    ``memory.stat``; ``runtime_shim.node.reclaim``): ``rss`` anonymous memory, ``cache`` page
    cache charged to it, ``shared`` the file pages its processes map (the ones other
    sandboxes of the same layers can share) plus shmem/tmpfs, ``usage`` the cgroup's total,
    and ``reclaimed`` what host-side reclaim has taken back from it so far."""

    rss: int
    cache: int
    shared: int
    usage: int
    reclaimed: int = 0


@dataclasses.dataclass(frozen=True)
class SandboxUsage:
    """What a running sandbox uses, sampled at ``at`` (Unix seconds; ``Sandbox.usage()``,
    ``runtime_shim.node.usage`` says where each figure comes from): ``cpu_seconds`` of CPU
    time since it started (a rate is the difference of two samples), ``cpus`` its CPU limit,
    memory and disk in bytes, processes as a count; a limit is None where there is none, a
    figure None where the sandbox has no such thing (no disk cap: no disk figures)."""

    at: float
    cpu_seconds: float
    cpus: float | None
    memory_bytes: int  # page cache included
    memory_cache: int
    memory_limit: int | None
    pids: int | None
    pids_limit: int | None
    disk_bytes: int | None
    disk_limit: int | None


@dataclasses.dataclass(frozen=True)
class SandboxInfo:
    """One sandbox on a node, as its ``sandbox.json`` records it (``Sandbox.info()``,
    ``list_sandboxes``). Times are Unix seconds; ``ready`` is 0 until the sandbox answered,
    ``expires`` 0 without a TTL."""

    id: str
    lock: str  # the lock's digest
    pid: int  # the process that created it
    alive: bool  # the creating process still runs
    kept: bool  # made with keep=True (envbuild run --keep): gc leaves it alone until its TTL
    created: float
    layers: tuple[str, ...]
    path: Path
    backend: str = "container"
    ready: float = 0.0
    node: str = ""  # the node dir
    ttl: float | None = None  # seconds
    expires: float = 0.0
    memory: MemoryInfo | None = None  # a live container/FnCall sandbox's (runtime_shim.node.reclaim)
    # microVMs: how the read-only layers reach the guest, "pmem-dax" (shared host page
    # cache) or "virtio-blk" (runtime_shim.backends.vm.backend.choose_layer_transport); else None.
    layer_transport: str | None = None
    lazy: str = ""  # lazy layers: "native", or "full pull: why" for a lazy request; "" if pulled
    runtime: str = ""  # the OCI runtime it was created with ("" in records made before 34)

    def expired(self, now: float) -> bool:
        return bool(self.expires) and now >= self.expires
