"""The default seccomp profile of every sandbox and build step (pure): an OCI ``linux.seccomp``.

Shape and syscall lists follow Docker's default (moby ``profiles/seccomp/default_linux.go``):
an allow-list with ``defaultAction: SCMP_ACT_ERRNO`` and ``defaultErrnoRet: EPERM``, so a
syscall nobody listed fails like a missing privilege, never kills the process; extra syscalls
are allowed only for the capabilities the container holds (``chroot`` with
``CAP_SYS_CHROOT``, …). What it refuses, whatever the capabilities (Docker would allow some of
them with ``CAP_SYS_ADMIN``; we never grant that group, a caller who needs it passes
``seccomp="unconfined"`` or a profile of their own):

- new namespaces of every kind: ``unshare`` and ``clone`` are allowed only when no
  ``CLONE_NEW*`` flag is set (a masked compare on the flags argument), ``setns`` never;
  ``clone3`` returns ``ENOSYS`` because seccomp cannot look into its struct argument, and
  libc then falls back to ``clone`` (glibc ≥ 2.34 does; this is what Docker does too);
- the mount family (``mount``, ``umount2``, ``pivot_root``, the new mount API), keyrings
  (``keyctl``, ``add_key``, ``request_key``), ``bpf``, ``perf_event_open``, ``userfaultfd``,
  ``kexec_*``, module loading, ``io_uring_*`` (off by default since Docker 25), swap, reboot,
  clock setting, ``quotactl``, ``lookup_dcookie``, ``open_by_handle_at``;
- ``inotify_init`` / ``inotify_init1`` (``ENOSYS``) unless the sandbox's ``Limits.inotify``
  allows them: inotify instances and watches are counted per uid (``fs.inotify.max_user_
  instances``, 128 by default, and ``max_user_watches``), and a sandbox's root is the host's
  uid 0, so a sandbox allowed them can exhaust the host root's (no cgroup bounds them; issue
  34, item 3);
- ioctls that swap a file's blocks with another's or inject terminal input: a deny list
  (``IOCTL_DENY``) matched on the low 32 bits only (the kernel's ``unsigned int cmd``), and for
  ``_IOC``-encoded requests on their type and number bytes only, so neither a different
  size/direction encoding nor junk in the upper half of the argument slips past.

The ioctl rules allow the complement of the deny list and nothing else (a denied request falls
to the default EPERM). Deny rules next to an unconditional ``ALLOW ioctl`` do not work, checked
with the real runc 1.1.5 + libseccomp 2.5.4 here: runc silently drops a rule whose action equals
the default action (ERRNO/EPERM), and with any other errno libseccomp lets the unconditional
allow win (whatever the order, or with the allow made conditional on another argument).
``SCMP_CMP_NE`` chains are no option either: runc turns several comparisons of one argument
into separate, OR-ed rules. So the complement is a union of masked compares (``IOCTL_ALLOW``,
65 rules of one condition each, OR-ed in every runtime; ~2.5 ms of runc's CPU per start);
``tests/security/test_syscalls.py`` checks the result against the real runc.

Syscalls newer than the libseccomp that runc links against are skipped by runc when it
builds the filter, and runc's own stub answers syscall numbers above the newest one it knows
with ``ENOSYS`` (so libc falls back, e.g. ``fchmodat2`` → ``fchmodat``); listing them here
costs nothing and allows them once runc's libseccomp knows them.

Not a boundary of the microVM backend: a microVM's guest kernel is (``runtime_shim.backends.vm``).
"""

from __future__ import annotations

import errno
import json
import platform
from collections.abc import Iterable, Mapping
from typing import Any

from envbuild.errors import RuntimeShimError

#: ``Sandbox.create(seccomp=UNCONFINED)``: no filter at all.
UNCONFINED = "unconfined"

# Docker's unconditional allow-list, minus io_uring_* (Docker 25 dropped them) and ioctl,
# which gets its own rules below. A few syscalls Docker added after the version we read
# (cachestat, fchmodat2, futex_*, map_shadow_stack) are ordinary and listed too.
ALLOWED = (
    "accept", "accept4", "access", "adjtimex", "alarm", "bind", "brk", "cachestat", "capget",
    "capset", "chdir", "chmod", "chown", "chown32", "clock_adjtime", "clock_adjtime64",
    "clock_getres", "clock_getres_time64", "clock_gettime", "clock_gettime64",
    "clock_nanosleep", "clock_nanosleep_time64", "close", "close_range", "connect",
    "copy_file_range", "creat", "dup", "dup2", "dup3", "epoll_create", "epoll_create1",
    "epoll_ctl", "epoll_ctl_old", "epoll_pwait", "epoll_pwait2", "epoll_wait", "epoll_wait_old",
    "eventfd", "eventfd2", "execve", "execveat", "exit", "exit_group", "faccessat",
    "faccessat2", "fadvise64", "fadvise64_64", "fallocate", "fanotify_mark", "fchdir", "fchmod",
    "fchmodat", "fchmodat2", "fchown", "fchown32", "fchownat", "fcntl", "fcntl64", "fdatasync",
    "fgetxattr", "flistxattr", "flock", "fork", "fremovexattr", "fsetxattr", "fstat", "fstat64",
    "fstatat64", "fstatfs", "fstatfs64", "fsync", "ftruncate", "ftruncate64", "futex",
    "futex_requeue", "futex_time64", "futex_wait", "futex_waitv", "futex_wake", "futimesat",
    "getcpu", "getcwd", "getdents", "getdents64", "getegid", "getegid32", "geteuid",
    "geteuid32", "getgid", "getgid32", "getgroups", "getgroups32", "getitimer", "getpeername",
    "getpgid", "getpgrp", "getpid", "getppid", "getpriority", "getrandom", "getresgid",
    "getresgid32", "getresuid", "getresuid32", "getrlimit", "get_robust_list", "getrusage",
    "getsid", "getsockname", "getsockopt", "get_thread_area", "gettid", "gettimeofday",
    "getuid", "getuid32", "getxattr", "inotify_add_watch",
    "inotify_rm_watch", "io_cancel", "io_destroy", "io_getevents", "io_pgetevents",
    "io_pgetevents_time64", "ioprio_get", "ioprio_set", "io_setup", "io_submit", "ipc", "kill",
    "landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self", "lchown",
    "lchown32", "lgetxattr", "link", "linkat", "listen", "listxattr", "llistxattr", "_llseek",
    "lremovexattr", "lseek", "lsetxattr", "lstat", "lstat64", "madvise", "map_shadow_stack",
    "membarrier", "memfd_create", "memfd_secret", "mincore", "mkdir", "mkdirat", "mknod",
    "mknodat", "mlock", "mlock2", "mlockall", "mmap", "mmap2", "mprotect", "mq_getsetattr",
    "mq_notify", "mq_open", "mq_timedreceive", "mq_timedreceive_time64", "mq_timedsend",
    "mq_timedsend_time64", "mq_unlink", "mremap", "msgctl", "msgget", "msgrcv", "msgsnd",
    "msync", "munlock", "munlockall", "munmap", "name_to_handle_at", "nanosleep",
    "newfstatat", "_newselect", "open", "openat", "openat2", "pause", "pidfd_open",
    "pidfd_send_signal", "pipe", "pipe2", "pkey_alloc", "pkey_free", "pkey_mprotect", "poll",
    "ppoll", "ppoll_time64", "prctl", "pread64", "preadv", "preadv2", "prlimit64",
    "process_mrelease", "pselect6", "pselect6_time64", "pwrite64", "pwritev", "pwritev2",
    "read", "readahead", "readlink", "readlinkat", "readv", "recv", "recvfrom", "recvmmsg",
    "recvmmsg_time64", "recvmsg", "remap_file_pages", "removexattr", "rename", "renameat",
    "renameat2", "restart_syscall", "rmdir", "rseq", "rt_sigaction", "rt_sigpending",
    "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait",
    "rt_sigtimedwait_time64", "rt_tgsigqueueinfo", "sched_getaffinity", "sched_getattr",
    "sched_getparam", "sched_get_priority_max", "sched_get_priority_min",
    "sched_getscheduler", "sched_rr_get_interval", "sched_rr_get_interval_time64",
    "sched_setaffinity", "sched_setattr", "sched_setparam", "sched_setscheduler",
    "sched_yield", "seccomp", "select", "semctl", "semget", "semop", "semtimedop",
    "semtimedop_time64", "send", "sendfile", "sendfile64", "sendmmsg", "sendmsg", "sendto",
    "setfsgid", "setfsgid32", "setfsuid", "setfsuid32", "setgid", "setgid32", "setgroups",
    "setgroups32", "setitimer", "setpgid", "setpriority", "setregid", "setregid32",
    "setresgid", "setresgid32", "setresuid", "setresuid32", "setreuid", "setreuid32",
    "setrlimit", "set_robust_list", "setsid", "setsockopt", "set_thread_area",
    "set_tid_address", "setuid", "setuid32", "setxattr", "shmat", "shmctl", "shmdt", "shmget",
    "shutdown", "sigaltstack", "signalfd", "signalfd4", "sigprocmask", "sigreturn",
    "socketcall", "socketpair", "splice", "stat", "stat64", "statfs", "statfs64", "statx",
    "symlink", "symlinkat", "sync", "sync_file_range", "syncfs", "sysinfo", "tee", "tgkill",
    "time", "timer_create", "timer_delete", "timer_getoverrun", "timer_gettime",
    "timer_gettime64", "timer_settime", "timer_settime64", "timerfd_create", "timerfd_gettime",
    "timerfd_gettime64", "timerfd_settime", "timerfd_settime64", "times", "tkill", "truncate",
    "truncate64", "ugetrlimit", "umask", "uname", "unlink", "unlinkat", "utime", "utimensat",
    "utimensat_time64", "utimes", "vfork", "vmsplice", "wait4", "waitid", "waitpid", "write",
    "writev",
    # Docker: allowed from kernel 4.8 on, when ptrace can no longer bypass seccomp.
    "process_vm_readv", "process_vm_writev", "ptrace",
)
#: Allowed only to a sandbox whose ``Limits.inotify`` says so (see the module docstring).
INOTIFY_INIT = ("inotify_init", "inotify_init1")

# Extra syscalls per capability (Docker's ``Includes: Caps``), except CAP_SYS_ADMIN's group
# (mount, namespaces, bpf, …), which this profile never grants.
BY_CAPABILITY: Mapping[str, tuple[str, ...]] = {
    "CAP_DAC_READ_SEARCH": ("open_by_handle_at",),
    "CAP_SYS_BOOT": ("reboot",),
    "CAP_SYS_CHROOT": ("chroot",),
    "CAP_SYS_PACCT": ("acct",),
    "CAP_SYS_PTRACE": ("kcmp", "pidfd_getfd", "process_madvise"),
    "CAP_SYS_RAWIO": ("iopl", "ioperm"),
    "CAP_SYS_TIME": ("settimeofday", "stime", "clock_settime", "clock_settime64"),
    "CAP_SYS_TTY_CONFIG": ("vhangup",),
    "CAP_SYS_NICE": ("get_mempolicy", "mbind", "set_mempolicy", "set_mempolicy_home_node"),
    "CAP_SYSLOG": ("syslog",),
}

# Per native architecture: the ABIs a process can enter the kernel with (Docker's archMap)
# and the arch-specific syscalls they need. A syscall from an ABI not listed kills the process
# (runc's bad-arch action), so none bypasses the filter; the 32-bit ABIs are listed so 32-bit
# binaries work, filtered alike (a 64-bit process's ``int 0x80`` included). Unlike Docker we
# leave out x32: each ABI costs runc ~10-20 ms of filter compilation per container start
# (measured: x86_64 alone +0 ms, with x86 +13 ms, with x86 and x32 +33 ms), and x32 has no
# userland to speak of (Debian's kernels disable it: its syscalls answer ENOSYS anyway).
ARCHITECTURES: Mapping[str, tuple[str, ...]] = {
    "x86_64": ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86"),
    "aarch64": ("SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"),
}
ARCH_SYSCALLS: Mapping[str, tuple[str, ...]] = {
    "x86_64": ("arch_prctl", "modify_ldt"),
    "aarch64": ("arm_fadvise64_64", "arm_sync_file_range", "sync_file_range2", "breakpoint",
                "cacheflush", "set_tls"),
}

# <linux/sched.h>
CLONE_NEWTIME = 0x00000080
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
#: clone's low byte is the exit signal, so CLONE_NEWTIME (0x80) can only be refused for unshare
#: (clone cannot create a time namespace: only unshare and clone3 can).
CLONE_NAMESPACES = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER
                    | CLONE_NEWPID | CLONE_NEWNET)
UNSHARE_NAMESPACES = CLONE_NAMESPACES | CLONE_NEWTIME

AF_VSOCK = 40

#: ioctl requests refused with EPERM, as (name, value, mask): a request matches when
#: ``cmd & mask == value``. For ``_IOC``-encoded requests the mask keeps the type and number
#: bytes only, so every size/direction variant (32-bit compat structs) is covered; legacy tty
#: requests are matched whole. Only the low 32 bits count: the kernel truncates ``cmd`` to an
#: unsigned int, and so does the mask.
IOCTL_DENY: tuple[tuple[str, int, int], ...] = (
    # Swap or move a file's extents with another file's: filesystem-corruption surface.
    ("XFS_IOC_SWAPEXT", (ord("X") << 8) | 109, 0xFFFF),
    ("XFS_IOC_EXCHANGE_RANGE", (ord("X") << 8) | 129, 0xFFFF),
    ("EXT4_IOC_MOVE_EXT", (ord("f") << 8) | 15, 0xFFFF),
    ("EXT4_IOC_SWAP_BOOT", (ord("f") << 8) | 17, 0xFFFF),
    # Make a btrfs subvolume or snapshot (no capability needed): on the node's disk pool one
    # would be a quota group of its own (runtime_shim.isolation.quotafs caps the sandbox's
    # through a level-1 group new subvolumes join; this keeps them from existing at all).
    ("BTRFS_IOC_SNAP_CREATE", (0x94 << 8) | 1, 0xFFFF),
    ("BTRFS_IOC_SUBVOL_CREATE", (0x94 << 8) | 14, 0xFFFF),
    ("BTRFS_IOC_SNAP_CREATE_V2", (0x94 << 8) | 23, 0xFFFF),
    ("BTRFS_IOC_SUBVOL_CREATE_V2", (0x94 << 8) | 24, 0xFFFF),
    # Push input into a terminal another process reads (a classic escape to a host tty).
    ("TIOCSTI", 0x5412, 0xFFFFFFFF),
    ("TIOCLINUX", 0x541C, 0xFFFFFFFF),
)


def _complement(deny: tuple[tuple[str, int, int], ...]) -> tuple[tuple[int, int], ...]:
    """(mask, value) pairs whose union is every 32-bit request not matched by ``deny``: split
    on one bit of a deny entry at a time; a branch no entry can match is emitted whole, a
    branch inside an entry is dropped. Disjoint, at most one pair per fixed bit of an entry."""
    cubes = [(mask, value) for _name, value, mask in deny]
    out: list[tuple[int, int]] = []

    def split(fixed: int, bits: int) -> None:
        live = [(m, v) for m, v in cubes if (v ^ bits) & m & fixed == 0]
        if not live:
            out.append((fixed, bits))
            return
        if any(m & ~fixed == 0 for m, _v in live):
            return  # every request here is denied
        m, v = min(live, key=lambda c: bin(c[0] & ~fixed).count("1"))
        bit = 1 << ((m & ~fixed).bit_length() - 1)
        split(fixed | bit, bits | (v & bit))
        split(fixed | bit, bits | (~v & bit))

    split(0, 0)
    return tuple(out)


#: The ioctl requests allowed, as (mask, value) pairs: the complement of ``IOCTL_DENY``.
IOCTL_ALLOW = _complement(IOCTL_DENY)


def default_profile(capabilities: Iterable[str] = (), machine: str | None = None, *,
                    inotify: bool = False) -> dict[str, Any]:
    """The default ``linux.seccomp`` for a container holding ``capabilities`` (their
    bounding set), for the native architecture ``machine`` (``platform.machine()`` when
    None; an unknown one gets native-only filtering); ``inotify``: allow ``INOTIFY_INIT``."""
    machine = machine or platform.machine()
    caps = set(capabilities)
    allowed = list(ALLOWED) + list(ARCH_SYSCALLS.get(machine, ()))
    allowed += INOTIFY_INIT if inotify else ()
    for cap, names in BY_CAPABILITY.items():
        if cap in caps:
            allowed += names
    eperm = errno.EPERM
    syscalls: list[dict[str, Any]] = [
        {"names": sorted(set(allowed)), "action": "SCMP_ACT_ALLOW"},
        *({"names": ["ioctl"], "action": "SCMP_ACT_ALLOW",
           # MASKED_EQ: ``value`` is the mask, ``valueTwo`` what the masked bits must equal
           "args": [{"index": 1, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}]}
          for mask, value in IOCTL_ALLOW),
        # AF_VSOCK would reach the host's vsock services (Docker refuses it too).
        {"names": ["socket"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_NE"}]},
        # Docker's personality values: Linux, with UNAME26 and/or ADDR_NO_RANDOMIZE, query.
        *({"names": ["personality"], "action": "SCMP_ACT_ALLOW",
           "args": [{"index": 0, "value": v, "op": "SCMP_CMP_EQ"}]}
          for v in (0x0, 0x0008, 0x20000, 0x20008, 0xFFFFFFFF)),
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": CLONE_NAMESPACES, "valueTwo": 0,
                   "op": "SCMP_CMP_MASKED_EQ"}]},
        {"names": ["unshare"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": UNSHARE_NAMESPACES, "valueTwo": 0,
                   "op": "SCMP_CMP_MASKED_EQ"}]},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
        # ENOSYS, as on a kernel without inotify: tail -f and most watchers fall back to polling
        *([] if inotify else
          [{"names": list(INOTIFY_INIT), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS}]),
    ]
    profile: dict[str, Any] = {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": eperm,
                               "syscalls": syscalls}
    if machine in ARCHITECTURES:
        profile["architectures"] = list(ARCHITECTURES[machine])
    return profile


# --- a caller's own profile: the structure the OCI schema allows, checked without it --------

_ACTIONS = frozenset({"SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL_THREAD",
                      "SCMP_ACT_TRAP", "SCMP_ACT_ERRNO", "SCMP_ACT_TRACE", "SCMP_ACT_ALLOW",
                      "SCMP_ACT_LOG", "SCMP_ACT_NOTIFY"})
_ARCHES = frozenset({"SCMP_ARCH_X86", "SCMP_ARCH_X86_64", "SCMP_ARCH_X32", "SCMP_ARCH_ARM",
                     "SCMP_ARCH_AARCH64", "SCMP_ARCH_LOONGARCH64", "SCMP_ARCH_M68K",
                     "SCMP_ARCH_MIPS", "SCMP_ARCH_MIPS64", "SCMP_ARCH_MIPS64N32",
                     "SCMP_ARCH_MIPSEL", "SCMP_ARCH_MIPSEL64", "SCMP_ARCH_MIPSEL64N32",
                     "SCMP_ARCH_PPC", "SCMP_ARCH_PPC64", "SCMP_ARCH_PPC64LE", "SCMP_ARCH_S390",
                     "SCMP_ARCH_S390X", "SCMP_ARCH_SH", "SCMP_ARCH_SHEB", "SCMP_ARCH_PARISC",
                     "SCMP_ARCH_PARISC64", "SCMP_ARCH_RISCV64"})
_FLAGS = frozenset({"SECCOMP_FILTER_FLAG_TSYNC", "SECCOMP_FILTER_FLAG_LOG",
                    "SECCOMP_FILTER_FLAG_SPEC_ALLOW", "SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV"})
_OPS = frozenset({"SCMP_CMP_NE", "SCMP_CMP_LT", "SCMP_CMP_LE", "SCMP_CMP_EQ", "SCMP_CMP_GE",
                  "SCMP_CMP_GT", "SCMP_CMP_MASKED_EQ"})
_HINT = "pass an OCI linux.seccomp object (runtime-spec config-linux.md), None or 'unconfined'"


def _fail(where: str, what: str) -> RuntimeShimError:
    return RuntimeShimError(f"seccomp profile: {where}: {what}", hint=_HINT)


def _uint(where: str, value: Any, bits: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << bits):
        raise _fail(where, f"{value!r} is not a uint{bits}")


def _keys(where: str, obj: Any, allowed: set[str], required: set[str]) -> None:
    if not isinstance(obj, Mapping):
        raise _fail(where, f"expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise _fail(where, f"unknown key {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(obj))
    if missing:
        raise _fail(where, f"missing {missing[0]!r}")


def _enum(where: str, value: Any, known: frozenset[str]) -> None:
    if value not in known:
        raise _fail(where, f"{value!r} is not one of {', '.join(sorted(known))}")


def _list(where: str, value: Any) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise _fail(where, f"expected a list, got {type(value).__name__}")
    return list(value)


def check_profile(profile: Mapping[str, Any]) -> dict[str, Any]:
    """``profile`` as a plain dict if it has the structure of the OCI ``linux.seccomp``
    object (the schema's types, enums and required keys; unknown keys are refused too, they
    are typos runc would ignore); a ``RuntimeShimError`` naming the first problem otherwise.
    The tests check this agrees with the runtime-spec JSON Schema."""
    _keys("top level", profile, {"defaultAction", "defaultErrnoRet", "flags", "listenerPath",
                                 "listenerMetadata", "architectures", "syscalls"},
          {"defaultAction"})
    _enum("defaultAction", profile["defaultAction"], _ACTIONS)
    if "defaultErrnoRet" in profile:
        _uint("defaultErrnoRet", profile["defaultErrnoRet"], 32)
    for i, flag in enumerate(_list("flags", profile.get("flags", []))):
        _enum(f"flags[{i}]", flag, _FLAGS)
    for key in ("listenerPath", "listenerMetadata"):
        if key in profile and not isinstance(profile[key], str):
            raise _fail(key, "expected a string")
    for i, arch in enumerate(_list("architectures", profile.get("architectures", []))):
        _enum(f"architectures[{i}]", arch, _ARCHES)
    for i, rule in enumerate(_list("syscalls", profile.get("syscalls", []))):
        where = f"syscalls[{i}]"
        _keys(where, rule, {"names", "action", "errnoRet", "args"}, {"names", "action"})
        names = _list(f"{where}.names", rule["names"])
        if not names or not all(isinstance(n, str) for n in names):
            raise _fail(f"{where}.names", "expected a non-empty list of syscall names")
        _enum(f"{where}.action", rule["action"], _ACTIONS)
        if "errnoRet" in rule:
            _uint(f"{where}.errnoRet", rule["errnoRet"], 32)
        for j, arg in enumerate(_list(f"{where}.args", rule.get("args", []))):
            at = f"{where}.args[{j}]"
            _keys(at, arg, {"index", "value", "valueTwo", "op"}, {"index", "value", "op"})
            _uint(f"{at}.index", arg["index"], 32)
            _uint(f"{at}.value", arg["value"], 64)
            if "valueTwo" in arg:
                _uint(f"{at}.valueTwo", arg["valueTwo"], 64)
            _enum(f"{at}.op", arg["op"], _OPS)
    return json.loads(json.dumps(profile))  # a deep, plain copy: the caller may mutate theirs


def check_setting(seccomp: str | Mapping[str, Any] | None) -> None:
    """Refuse a ``seccomp=`` argument that is not None, ``"unconfined"`` or a valid profile."""
    if seccomp is None or seccomp == UNCONFINED:
        return
    if isinstance(seccomp, str):
        raise RuntimeShimError(f"unknown seccomp setting {seccomp!r}", hint=_HINT)
    check_profile(seccomp)


def resolve(seccomp: str | Mapping[str, Any] | None, capabilities: Iterable[str],
            machine: str | None = None, *, inotify: bool = False) -> dict[str, Any] | None:
    """The ``linux.seccomp`` object for a ``seccomp=`` setting: None → the default profile
    for ``capabilities`` (``inotify`` as for ``default_profile``), ``"unconfined"`` → no
    filter (None), a mapping → itself, checked."""
    check_setting(seccomp)
    if seccomp is None:
        return default_profile(capabilities, machine, inotify=inotify)
    if seccomp == UNCONFINED:
        return None
    assert isinstance(seccomp, Mapping)
    return check_profile(seccomp)
