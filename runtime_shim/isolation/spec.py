"""OCI runtime spec generation (pure): a frozen request in, a ``config.json`` mapping out.

Used for both build steps (envbuild's executor) and sandboxes, so isolation is decided in one
place. Secure by default: every namespace but the user namespace is new (an empty network
namespace unless ``network=True``), ``noNewPrivileges``, a capability set narrower than
Docker's default (no ``NET_RAW``, no ``MKNOD``), Docker's masked and read-only ``/proc`` and
``/sys`` paths, a read-only ``/sys``, and rlimits that the caller has already clamped to the
host's hard limits (root here lacks ``CAP_SYS_RESOURCE``; raising a limit makes runc fail),
Docker's default seccomp profile narrowed further (``runtime_shim.isolation.seccomp``: no new namespaces,
no mounts, keyrings, bpf, io_uring, module loading; a deny list of filesystem-swapping ioctls)
unless the request says ``seccomp="unconfined"`` or brings its own, and a CPU bandwidth cap.

The result validates against the OCI runtime-spec JSON Schema (``config-schema.json``); a test
checks that for every request shape the code can produce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from runtime_shim.isolation import seccomp as _seccomp

OCI_VERSION = "1.0.2"

# Docker's default set (moby oci/caps/defaults.go) without NET_RAW (raw sockets let a sandbox
# spoof traffic) and MKNOD (no device nodes in sandboxes; the device cgroup would refuse their
# use anyway, but creating them lands them in pack-diff input).
DEFAULT_CAPABILITIES = (
    "CAP_AUDIT_WRITE",
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_NET_BIND_SERVICE",
    "CAP_SETFCAP",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_SETUID",
    "CAP_SYS_CHROOT",
)

# Docker's defaults (moby oci/defaults.go): kernel interfaces a container must not read or write.
MASKED_PATHS = (
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
READONLY_PATHS = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
)

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The CFS period a CPU limit is expressed in (the kernel's default, 100 ms): ``cpus=0.5`` is a
#: quota of 50 ms per period.
CPU_PERIOD_US = 100_000
#: Size and inode cap of each ``tmpfs`` mount (``/tmp`` when the caller keeps the default): an
#: uncapped tmpfs takes up to half the host's RAM. Sandboxes and build steps put ``/tmp`` on
#: their capped disk instead (``runtime_shim.isolation.scratchfs``) and pass ``tmpfs=()``.
TMPFS_BYTES = 256 << 20
TMPFS_INODES = 65536


@dataclasses.dataclass(frozen=True)
class BindMount:
    source: str
    destination: str
    readonly: bool = True


@dataclasses.dataclass(frozen=True)
class Rlimit:
    type: str  # e.g. "RLIMIT_NOFILE"
    soft: int
    hard: int


@dataclasses.dataclass(frozen=True)
class RuntimeSpecRequest:
    """Everything that decides a container's config. Plain data; see ``runtime_spec``.

    ``env`` is ordered ``KEY=VALUE`` strings. ``memory_limit`` is bytes, ``pids_limit`` a count;
    either may be None where the host cannot enforce it (then the caller says so to the user).
    ``cgroups_path`` is None to let the runtime pick; the caller passes one per sandbox so
    limits are accounted per sandbox. ``cpus`` is CPU bandwidth in cores (``1.5`` = one and a
    half cores' worth of time per period), None for no cap. ``seccomp`` is None for the
    default profile (``runtime_shim.isolation.seccomp.default_profile`` for ``capabilities`` on
    ``machine``, the host's when None), ``"unconfined"`` for none, or a full OCI
    ``linux.seccomp`` object, emitted as given after a structural check.
    """

    rootfs: str
    args: tuple[str, ...]
    env: tuple[str, ...] = (f"PATH={DEFAULT_PATH}",)
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    additional_gids: tuple[int, ...] = ()
    hostname: str = "sandbox"
    network: bool = False
    # With ``network``: the namespace file to join (``runtime_shim.isolation.netns``: own namespace,
    # user-mode NAT, a firewall that holds because no capability set here has
    # CAP_NET_ADMIN); None with ``network`` shares the host's namespace (nothing does).
    network_ns: str | None = None
    readonly_rootfs: bool = False
    capabilities: tuple[str, ...] = DEFAULT_CAPABILITIES
    no_new_privileges: bool = True
    rlimits: tuple[Rlimit, ...] = ()
    pids_limit: int | None = None
    memory_limit: int | None = None
    cgroups_path: str | None = None
    binds: tuple[BindMount, ...] = ()
    tmpfs: tuple[str, ...] = ("/tmp",)
    tmpfs_bytes: int = TMPFS_BYTES
    tmpfs_inodes: int = TMPFS_INODES
    terminal: bool = False
    cpus: float | None = None
    # cgroup v1 ``cpu.shares`` / v2 ``cpu.weight`` (the runtime converts); None: the default
    # (1024). Low for best-effort sandboxes (``Limits.cpu_class``).
    cpu_shares: int | None = None
    seccomp: str | Mapping[str, Any] | None = None
    machine: str | None = None
    # With the default profile: allow inotify_init (``Limits.inotify``; runtime_shim.isolation.seccomp)
    inotify: bool = False


def parse_user(user: str | None, default: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """``"uid:gid"`` or ``"uid"`` → (uid, gid). Names are not resolved (no /etc/passwd read)."""
    if not user:
        return default
    uid_s, _, gid_s = str(user).partition(":")
    try:
        uid = int(uid_s)
        gid = int(gid_s) if gid_s else uid
    except ValueError:
        from envbuild.errors import RuntimeShimError

        raise RuntimeShimError(f"user {user!r} is not numeric",
                               hint="use 'UID:GID', e.g. '1000:1000'") from None
    return uid, gid


def clamped_rlimit(kind: str, wanted: int) -> Rlimit:
    """``wanted`` as soft and hard limit, lowered to this process's hard limit: raising it
    needs ``CAP_SYS_RESOURCE`` and would make the runtime fail."""
    import resource

    _soft, hard = resource.getrlimit(getattr(resource, kind))
    value = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    return Rlimit(kind, value, value)


def env_list(env: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(f"{k}={v}" for k, v in env.items())


def _mounts(req: RuntimeSpecRequest) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
    ]
    for path in req.tmpfs:
        mounts.append({"destination": path, "type": "tmpfs", "source": "tmpfs",
                       "options": ["nosuid", "nodev", "mode=1777", f"size={req.tmpfs_bytes}",
                                   f"nr_inodes={req.tmpfs_inodes}"]})
    for b in req.binds:
        opts = ["rbind", "nosuid", "nodev"] + (["ro"] if b.readonly else ["rw"])
        mounts.append({"destination": b.destination, "type": "bind", "source": b.source,
                       "options": opts})
    return mounts


def runtime_spec(req: RuntimeSpecRequest) -> dict[str, Any]:
    """The ``config.json`` for ``req``."""
    caps = list(req.capabilities)
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if not req.network:
        namespaces.append({"type": "network"})  # new and empty: only a down ``lo``
    elif req.network_ns is not None:
        namespaces.append({"type": "network", "path": req.network_ns})
    resources: dict[str, Any] = {"devices": [{"allow": False, "access": "rwm"}]}
    if req.pids_limit is not None:
        resources["pids"] = {"limit": req.pids_limit}
    if req.memory_limit is not None:
        # swap = memory: no swap beyond the limit
        resources["memory"] = {"limit": req.memory_limit, "swap": req.memory_limit}
    if req.cpus is not None:
        if not req.cpus > 0:
            from envbuild.errors import RuntimeShimError

            raise RuntimeShimError(f"cpus={req.cpus!r}: a CPU limit must be a positive number "
                                   "of cores", hint="e.g. 0.5, 2.0, or None for no limit")
        # cgroup v1 cpu.cfs_quota_us / v2 cpu.max; at least 1 ms, the kernel's minimum quota
        resources["cpu"] = {"quota": max(1000, round(req.cpus * CPU_PERIOD_US)),
                            "period": CPU_PERIOD_US}
    if req.cpu_shares is not None:
        resources.setdefault("cpu", {})["shares"] = req.cpu_shares
    linux: dict[str, Any] = {
        "namespaces": namespaces,
        "resources": resources,
        "maskedPaths": list(MASKED_PATHS),
        "readonlyPaths": list(READONLY_PATHS),
    }
    if req.cgroups_path is not None:
        linux["cgroupsPath"] = req.cgroups_path
    profile = _seccomp.resolve(req.seccomp, caps, req.machine, inotify=req.inotify)
    if profile is not None:
        linux["seccomp"] = profile
    process: dict[str, Any] = {
        "terminal": req.terminal,
        "user": {"uid": req.uid, "gid": req.gid},
        "args": list(req.args),
        "env": list(req.env),
        "cwd": req.cwd,
        "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
        "noNewPrivileges": req.no_new_privileges,
    }
    if req.additional_gids:
        process["user"]["additionalGids"] = list(req.additional_gids)
    if req.rlimits:
        process["rlimits"] = [{"type": r.type, "soft": r.soft, "hard": r.hard}
                              for r in req.rlimits]
    return {
        "ociVersion": OCI_VERSION,
        "process": process,
        "root": {"path": req.rootfs, "readonly": req.readonly_rootfs},
        "hostname": req.hostname,
        "mounts": _mounts(req),
        "linux": linux,
    }
