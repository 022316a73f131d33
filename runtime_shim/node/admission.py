"""Node admission: what the sandboxes and build disks of a node may take of host-wide tables.

A sandbox's limits bound it alone: 256 processes with 1024 open files each is within its
cgroup and rlimits, yet a few such sandboxes fill the host's file table (``fs.file-max``), and
then no unprivileged process of the host can open a file (issue 34, item 3). The same holds
for tasks (``kernel.pid_max`` / ``kernel.threads-max``) and for disk: a scratch disk is a
sparse file that costs nothing until written, so nothing stopped ten 10 GiB disks on a node
with 50 GiB free (item 7). So before a sandbox (or a build layer's scratch disk) is made, the
node checks that the worst case of everything it admitted, this one included, fits a budget,
and refuses it with one line naming the budget otherwise (``AdmissionRefused``).

What a container or FnCall sandbox reserves (``reservation``; pure):

- ``files``: ``Limits.pids × Limits.nofile`` — the open files its processes can hold at once
  (each process at most ``nofile`` descriptors, at most ``pids`` processes) — divided by the
  node's file overcommit (``ENVBUILD_FILES_OVERCOMMIT``, ``DEFAULT_FILES_OVERCOMMIT`` = 64 by
  default; ``1`` is the strict worst case). No cgroup bounds a sandbox's open files, so the
  worst case is the only figure the kernel enforces, and reserving it held ~7 default
  sandboxes on a 24 GiB host (issue 39, item 3): the file table is overcommitted instead, as
  memory is, and guarded by what is really open (below);
- ``tasks``: ``Limits.pids`` (the pids cgroup counts threads too);
- ``disk_bytes``: ``Limits.disk_bytes``, the size of its scratch disk.

That is what every backend is charged unless it says otherwise (``backend.HostCosted``): a
microVM's processes and files live in its guest, so on the host it reserves its disk and a
QEMU process's share (``vm_reservation``: ``VM_FILES``, ``VM_TASKS``). ``pids=None`` or
``memory_bytes=None`` on a container or FnCall sandbox is refused: without them neither table
nor the kernel memory its processes pin (charged to its memory cgroup) is bounded.
``disk_bytes=None`` (plain dirs on the node's filesystem, a documented opt-out of the disk cap)
reserves no disk.

The budget (``node_budget``; pure over what ``read_host`` measured at admission): each kernel
table's limit read from ``/proc/sys`` less a share kept for the host (``ENVBUILD_HOST_RESERVE``,
25% by default); and, since files are overcommitted, the files the whole host has open right
now (``fs.file-nr``) plus the new sandbox's share must fit the same share of ``fs.file-max``
too (``files_open``): no sandbox is admitted once the host's real table is at its budget;
disk: the free space of the node dir's filesystem less a share of its size kept
free (``ENVBUILD_DISK_RESERVE``, 5%). The disk check is conservative: a disk counts at its full
size for as long as it exists, although what it already wrote is no longer free. Explicit caps
(``ENVBUILD_NODE_BUDGET="files=N,tasks=N,disk=SIZE"``) lower any of them, e.g. for a node dir
that shares its host with others: the budget is per node dir, and the tables are the host's.

The ledger (``runtime_shim.node.ledger.Ledger``): one small file per reservation under
``<node cache>/admission.d/`` and a running total beside them, written under an exclusive
``flock`` of ``admission.lock``: an admission reads and writes the total and one entry, never
every reservation nor the sandboxes dir (the cost does not grow with what is alive). A
sandbox's entry is removed when it is closed or removed (``Sandbox.close``,
``remove_sandbox``, the sweep of a dead creator's sandboxes); a build's when its scratch dir is
released. An entry whose ``path`` no longer exists (its owner vanished without a word: a
rebooted host, a hand-deleted dir, a build reaped after its builder died) is dropped, but only
when an admission would otherwise be refused.

Build disks (``envbuild.build.executor``) differ in two ways: their cap is a safety cap, so a
disk the budget cannot hold in full gets what is left (``fit``; at least 1 GiB), and one that
does not fit even so waits for other builds to give theirs back before it is refused.

Descriptors are what counts: a file mapped and then closed no longer counts toward
``fs.file-nr`` (measured on 6.18: 30,000 such mappings in a sandbox left it unchanged, 20,000
open descriptors raised it by 20,000).

inotify instances and watches are per-uid counters a sandbox's root shares with the host's
root, and nothing bounds them per sandbox: so no budget here, they are off instead unless a
sandbox opts in (``Limits.inotify``; ``runtime_shim.isolation.seccomp``). Not covered: ``fs.aio-max-nr``
(host-wide, ``io_setup`` is allowed), inotify in a sandbox that opted in, and a build step's
tables (``BuildLimits``: 8192 tasks x 65536 files, bounded per step, not admitted).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from envbuild.errors import AdmissionRefused, SettingsError

LEDGER_NAME = "admission.json"  # version 1, converted by runtime_shim.node.ledger
LOCK_NAME = "admission.lock"
DEFAULT_HOST_RESERVE = 0.25
DEFAULT_DISK_RESERVE = 0.05
#: What a microVM takes of the host's tables: one QEMU process (its threads and fds).
VM_FILES = 1024
VM_TASKS = 64
#: By how much the sandboxes' worst cases of open files may overcommit the node's budget
#: (``ENVBUILD_FILES_OVERCOMMIT``): a default sandbox (256 × 1024) is charged 4,096 files.
DEFAULT_FILES_OVERCOMMIT = 64.0
#: How often a waiting admission (a build disk) looks again.
WAIT_POLL = 0.5
RESOURCES = ("files", "tasks", "disk_bytes")
_NAMES = {"files": "open files", "tasks": "tasks", "disk_bytes": "disk"}


@dataclasses.dataclass(frozen=True)
class Reservation:
    """What one sandbox or build disk may take, at worst, of each host-wide table."""

    files: int = 0
    tasks: int = 0
    disk_bytes: int = 0

    def __add__(self, other: Reservation) -> Reservation:
        return Reservation(*(getattr(self, r) + getattr(other, r) for r in RESOURCES))

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class HostTables:
    """The host's limits and the node filesystem's space, as measured (``read_host``)."""

    file_max: int
    pid_max: int
    threads_max: int
    disk_free: int  # bytes available to the node dir's filesystem's users
    disk_size: int
    files_open: int = 0  # the host's allocated files now (fs.file-nr's first field)


@dataclasses.dataclass(frozen=True)
class BudgetSettings:
    """How much of the host the node may give away (``from_env`` reads the variables)."""

    host_reserve: float = DEFAULT_HOST_RESERVE  # share of each kernel table kept for the host
    disk_reserve: float = DEFAULT_DISK_RESERVE  # share of the filesystem's size kept free
    caps: Mapping[str, int] = dataclasses.field(default_factory=dict)  # explicit ceilings
    files_overcommit: float = DEFAULT_FILES_OVERCOMMIT  # 1: reserve the worst case

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> BudgetSettings:
        return cls(host_reserve=_share(environ, "ENVBUILD_HOST_RESERVE", DEFAULT_HOST_RESERVE),
                   disk_reserve=_share(environ, "ENVBUILD_DISK_RESERVE", DEFAULT_DISK_RESERVE),
                   caps=parse_caps(environ.get("ENVBUILD_NODE_BUDGET", "")),
                   files_overcommit=_overcommit(environ))


@dataclasses.dataclass(frozen=True)
class NodeBudget:
    """The node's budget of each resource, and how each was arrived at (for messages)."""

    limits: Reservation
    sources: Mapping[str, str]
    files_open: int = 0  # what the host has open now (``HostTables.files_open``)
    files_table: int = 0  # the share of fs.file-max that may be open at all (no cap lowers it)


def _share(environ: Mapping[str, str], name: str, default: float) -> float:
    text = environ.get(name, "").strip()
    if not text:
        return default
    from envbuild.sizes import parse_percent

    return parse_percent(text, what=name, below_100=True)


def _overcommit(environ: Mapping[str, str]) -> float:
    text = environ.get("ENVBUILD_FILES_OVERCOMMIT", "").strip()
    if not text:
        return DEFAULT_FILES_OVERCOMMIT
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 1 <= value < float("inf"):
        raise SettingsError(f"ENVBUILD_FILES_OVERCOMMIT: not a number >= 1: {text!r}",
                            hint="e.g. 64 (the default), or 1 to reserve every sandbox's "
                                 "worst case")
    return value


def parse_caps(text: str) -> dict[str, int]:
    """``"files=100000,tasks=4096,disk=20G"`` → ``{"files": ..., "tasks": ..., "disk_bytes":
    ...}`` (``ENVBUILD_NODE_BUDGET``); ``SettingsError`` for anything else."""
    from envbuild.sizes import parse_size

    caps: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        key = {"files": "files", "tasks": "tasks", "disk": "disk_bytes"}.get(name.strip())
        try:
            if key is None or not value.strip():
                raise ValueError
            caps[key] = parse_size(value) if key == "disk_bytes" else int(value)
            if caps[key] < 0:
                raise ValueError
        except (ValueError, SettingsError):
            raise SettingsError(f"ENVBUILD_NODE_BUDGET: not a budget: {item!r}",
                                hint="e.g. files=100000,tasks=4096,disk=20G") from None
    return caps


def node_budget(host: HostTables, settings: BudgetSettings) -> NodeBudget:
    """The budget of each resource for ``host`` (pure)."""
    keep = 1 - settings.host_reserve
    pct = f"{round(keep * 100)}%"
    tasks_from, tasks_max = min(("kernel.pid_max", host.pid_max),
                                ("kernel.threads-max", host.threads_max), key=lambda t: t[1])
    disk_kept = int(host.disk_size * settings.disk_reserve)
    limits = {"files": int(host.file_max * keep), "tasks": int(tasks_max * keep),
              "disk_bytes": max(0, host.disk_free - disk_kept)}
    sources = {"files": f"{pct} of fs.file-max {host.file_max}",
               "files_open": f"{pct} of fs.file-max {host.file_max}",
               "tasks": f"{pct} of {tasks_from} {tasks_max}",
               "disk_bytes": f"the node filesystem's {_gib(host.disk_free)} free less "
                             f"{_gib(disk_kept)} kept free"}
    for key, cap in settings.caps.items():
        if cap < limits[key]:
            limits[key] = cap
            shown = _gib(cap) if key == "disk_bytes" else cap
            sources[key] = f"ENVBUILD_NODE_BUDGET {key.removesuffix('_bytes')}={shown}"
    return NodeBudget(Reservation(**limits), sources, files_open=host.files_open,
                      files_table=int(host.file_max * keep))


def vm_reservation(limits) -> Reservation:
    """What a microVM of ``limits`` reserves (pure): its disk and one QEMU process."""
    return Reservation(VM_FILES, VM_TASKS, limits.disk_bytes or 0)


def reservation(limits, files_overcommit: float = 1.0) -> Reservation:
    """What a container (or FnCall) sandbox of ``limits`` (``runtime_shim.node.model.Limits``)
    reserves (pure): the charge of every backend that does not say otherwise
    (``backend.HostCosted``); its worst case of open files divided by ``files_overcommit``
    (rounded up; 1: the worst case itself); ``AdmissionRefused`` without a pids or memory
    limit."""
    disk = limits.disk_bytes or 0
    for field, value in (("pids", limits.pids), ("memory_bytes", limits.memory_bytes)):
        if value is None:
            raise AdmissionRefused(
                f"Limits.{field}=None: a sandbox without it could exhaust the host's "
                f"{'process and file tables' if field == 'pids' else 'kernel memory'}",
                hint=f"set Limits.{field} (the default is {_default(field)})")
    return Reservation(math.ceil(limits.pids * limits.nofile / files_overcommit), limits.pids,
                       disk)


def _default(field: str) -> object:
    from runtime_shim.node.model import Limits

    return getattr(Limits(), field)


def refusal(budget: NodeBudget, committed: Reservation, holders: int, new: Reservation,
            what: str) -> tuple[str, str] | None:
    """``(resource, the one line refusing new)`` (for ``what``, e.g. "sandbox eb-…") when
    ``committed`` (reserved by ``holders`` others) plus ``new`` exceeds a budget; None when it
    fits (pure)."""
    for key in RESOURCES:
        want, held, limit = getattr(new, key), getattr(committed, key), getattr(budget.limits, key)
        if want and held + want > limit:
            fmt = _gib if key == "disk_bytes" else str
            return key, (f"node budget of {_NAMES[key]} exceeded: {what} needs {fmt(want)}, "
                         f"{fmt(held)} reserved by {holders} other(s), budget {fmt(limit)} "
                         f"({budget.sources[key]})")
    if new.files and budget.files_table and budget.files_open + new.files > budget.files_table:
        return "files_open", (f"node budget of open files exceeded: {what} needs {new.files}, "
                              f"the host has {budget.files_open} open now (fs.file-nr), budget "
                              f"{budget.files_table} ({budget.sources['files_open']})")
    return None


def fit(budget: NodeBudget, committed: Reservation, want: Reservation,
        min_disk: int | None) -> Reservation:
    """``want`` with its disk lowered to what ``budget`` has left after ``committed`` (whole
    MiB), if that is less and at least ``min_disk``; else ``want`` (pure)."""
    room = (budget.limits.disk_bytes - committed.disk_bytes) // (1 << 20) << 20
    if min_disk is None or want.disk_bytes <= room or room < min_disk:
        return want
    return dataclasses.replace(want, disk_bytes=room)


def _gib(n: int) -> str:
    """A size for messages: ``1.5 GiB``, ``64 MiB``."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def read_host(node_dir: str | os.PathLike[str], proc_sys: str = "/proc/sys") -> HostTables:
    """The host's table limits (``/proc/sys``) and the space of ``node_dir``'s filesystem."""
    def sysctl(name: str) -> int:
        with open(os.path.join(proc_sys, name)) as f:
            return int(f.read().split()[0])

    st = os.statvfs(node_dir)
    return HostTables(file_max=sysctl("fs/file-max"), pid_max=sysctl("kernel/pid_max"),
                      threads_max=sysctl("kernel/threads-max"),
                      disk_free=st.f_bavail * st.f_frsize, disk_size=st.f_blocks * st.f_frsize,
                      files_open=sysctl("fs/file-nr"))


HINTS = {"files": "close sandboxes, lower Limits.pids or Limits.nofile, or raise fs.file-max",
         "files_open": "close sandboxes, find what holds the host's open files (fs.file-nr), "
                       "or raise fs.file-max",
         "tasks": "close sandboxes, lower Limits.pids, or raise kernel.pid_max",
         "disk_bytes": "close sandboxes, lower Limits.disk_bytes (or ENVBUILD_BUILD_DISK), or "
                       "free disk space on the node"}


def entry_reservation(e: Mapping[str, object]) -> Reservation:
    """The reservation a ledger entry (or total) records."""
    return Reservation(*(int(e.get(r, 0) or 0) for r in RESOURCES))  # type: ignore[call-overload]


def sandbox_key(sandbox_id: str) -> str:
    return f"sandbox:{sandbox_id}"


def build_key(scratch_name: str) -> str:
    return f"build:{scratch_name}"
