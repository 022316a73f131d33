"""CPU classes (``Limits.cpu_class``): latency-sensitive sandboxes keep their tail latency while
best-effort ones (and build steps, by default) soak up what is left.

Two levers, both applied to every process of a best-effort sandbox:

- ``SCHED_IDLE``: the kernel runs such a thread only when no normal thread wants the CPU (its
  weight is 3 against 1024 for nice 0), and wakes a normal thread in preference to it. runc
  1.1.5 (OCI runtime-spec 1.0.2, ``runc features``) has no ``process.scheduler`` field (added in
  runtime-spec 1.2 / runc 1.2), so the host sets it: on the sandbox's PID 1 (the exec agent)
  right after ``runc run --detach`` returns, before it runs anything; every command the agent
  forks inherits it. A process cannot leave ``SCHED_IDLE`` without ``CAP_SYS_NICE`` (never
  granted) or a non-zero ``RLIMIT_NICE`` (0 here). Foreground build steps run ``runc run``
  under ``chrt --idle 0``: ``runc init`` and the step inherit the policy.
- a low CPU weight for the sandbox's cgroup (``BEST_EFFORT_SHARES``): ``cpu.shares`` on this
  host's cgroup v1 ``cpu`` controller (the hybrid layout: runc puts ``/envbuild/<id>`` in each
  v1 hierarchy, the cgroup2 mount at ``/sys/fs/cgroup/unified`` has no controllers), the same
  field becoming ``cpu.weight`` where runc drives cgroup v2. Shares are relative among
  siblings, and every sandbox and build step is a child of ``/envbuild``.
"""

from __future__ import annotations

import os

from envbuild.errors import RuntimeShimError

LATENCY = "latency"
BEST_EFFORT = "best-effort"
CPU_CLASSES = (LATENCY, BEST_EFFORT)
#: What build steps run as unless told otherwise (``envbuild.build.executor``).
BUILD_CPU_CLASS = BEST_EFFORT
#: ``cpu.shares`` of a best-effort cgroup: the kernel's minimum (2); a latency one keeps 1024.
BEST_EFFORT_SHARES = 2


def check(cpu_class: str) -> None:
    if cpu_class not in CPU_CLASSES:
        raise RuntimeShimError(f"unknown cpu_class {cpu_class!r}",
                               hint=f"choose one of: {', '.join(CPU_CLASSES)}")


def cpu_shares(cpu_class: str) -> int | None:
    """The ``cpu.shares`` of a sandbox of ``cpu_class`` (None: the runtime's default)."""
    check(cpu_class)
    return BEST_EFFORT_SHARES if cpu_class == BEST_EFFORT else None


def apply(pid: int, cpu_class: str) -> None:
    """Put ``pid`` (a sandbox's PID 1, before it runs anything) in ``cpu_class``'s policy;
    the processes it starts inherit it. Nothing to do for the latency class."""
    check(cpu_class)
    if cpu_class != BEST_EFFORT:
        return
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as e:
        raise RuntimeShimError(f"set SCHED_IDLE on sandbox process {pid}: {e.strerror}") from e


def wrap_argv(argv: list[str], cpu_class: str) -> list[str]:
    """``argv`` run in ``cpu_class`` (for a foreground ``runc run``): under ``chrt --idle 0``
    for best-effort."""
    check(cpu_class)
    return ["chrt", "--idle", "0", *argv] if cpu_class == BEST_EFFORT else argv


def policy_of(pid: int) -> str:
    """The CPU class ``pid`` runs in, as the kernel says (for tests and ``info``)."""
    return BEST_EFFORT if os.sched_getscheduler(pid) == os.SCHED_IDLE else LATENCY
