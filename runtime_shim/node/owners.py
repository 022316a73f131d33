"""Which processes create sandboxes on a node, so that the sweep at each create costs
O(creators), not O(sandboxes) (issue 39: create cost independent of what is alive).

``Sandbox.create`` sweeps the node first: sandboxes whose creator died (a crash, ``kill -9``)
and sandboxes past their TTL are removed, so that a crashed trainer's leftovers do not hold
the node's budget. Reading every sandbox's record for that grew with the sandboxes alive
(19 ms at 400 of them). This index says when a full sweep can find nothing:

- ``owners/<pid>-<start>``: one empty file per process that created sandboxes
  here (``register``, once per process and node). ``<start>`` is the process's start time
  (``/proc/PID/stat`` field 22), so a reused pid is not taken for the creator;
- ``owners/next-expiry``: the earliest TTL expiry of any sandbox (0: none);
- ``owners/swept``: a full sweep ran since the index exists (a node dir from an
  older envbuild is swept in full once).

``sweep_needed`` is false only when the index exists, every registered creator is alive and
no expiry has passed: then a full sweep would remove nothing. ``after_sweep`` (run by every
full sweep) rewrites the earliest expiry and forgets creators that are gone and have no
sandbox left to reap. The index is a hint that can only cause extra sweeps, never fewer:
each creator registers before it writes its first record, and a full sweep still decides
from the records.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from envbuild.atomic import write_atomic
from runtime_shim.node.layout import NodeLayout

NEXT_EXPIRY = "next-expiry"
SWEPT = "swept"
_registered: set[tuple[str, int]] = set()  # (owners dir, pid) this process registered in


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:  # after the command's ")": the fields from the third on; starttime is field 22
        return int(stat.rsplit(b")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def owner_alive(pid: int, start: int | None) -> bool:
    """Whether the process ``pid`` that started at ``start`` (None: unknown) still runs."""
    if pid <= 0:
        return False
    now = process_start(pid)
    return now is not None and (start is None or now == start)


def _dir(layout: NodeLayout) -> Path:
    return layout.owners


def register(layout: NodeLayout, expires: float = 0.0) -> None:
    """Note this process as a creator on ``layout`` (before its record is written) and, for
    a sandbox with a TTL, its expiry."""
    d = _dir(layout)
    pid = os.getpid()
    if (str(d), pid) not in _registered:
        d.mkdir(mode=0o700, exist_ok=True)
        (d / f"{pid}-{process_start(pid) or 0}").touch()
        _registered.add((str(d), pid))
    if expires:
        with _locked(d) as current:
            if current == 0 or expires < current:
                write_atomic(d / NEXT_EXPIRY, repr(expires))


@contextlib.contextmanager
def _locked(d: Path) -> Iterator[float]:
    """The earliest expiry, with ``d``'s lock held (one writer of next-expiry at a time)."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield _next_expiry(d)
    finally:
        os.close(fd)


def _next_expiry(d: Path) -> float:
    try:
        return float((d / NEXT_EXPIRY).read_text() or 0)
    except (OSError, ValueError):
        return 0.0


def _owners(d: Path) -> Iterator[tuple[str, int, int]]:
    for name in os.listdir(d):
        pid, _, start = name.partition("-")
        if pid.isdigit() and start.isdigit():
            yield name, int(pid), int(start)


def sweep_needed(layout: NodeLayout, now: float) -> bool:
    """Whether a full sweep of ``layout`` could remove something (see the module docstring)."""
    d = _dir(layout)
    try:
        if not (d / SWEPT).exists():
            return True
        expiry = _next_expiry(d)
        if expiry and now >= expiry:
            return True
        return any(not owner_alive(pid, start or None) for _, pid, start in _owners(d))
    except OSError:
        return True


def after_sweep(layout: NodeLayout, remaining: Iterable[tuple[int, bool, float]],
                started: float) -> None:
    """Record what a full sweep that began at ``started`` left: ``remaining`` is ``(creator
    pid, kept, expires)`` of each sandbox still on the node. Creators that are gone and left
    nothing but kept sandboxes are forgotten (kept ones are reaped by their TTL, not by their
    creator's death). An expiry registered while the sweep ran is kept."""
    d = _dir(layout)
    if not layout.root.is_dir():  # a sweep of a node dir that was never made: nothing to note
        return
    d.mkdir(mode=0o700, exist_ok=True)
    reapable, expiries = set(), []
    for pid, kept, expires in remaining:
        if not kept:
            reapable.add(pid)
        if expires:
            expiries.append(expires)
    for name, pid, start in list(_owners(d)):
        if not owner_alive(pid, start or None) and pid not in reapable:
            with contextlib.suppress(FileNotFoundError):
                (d / name).unlink()
    with _locked(d) as current:
        with contextlib.suppress(OSError):
            if current and (d / NEXT_EXPIRY).stat().st_mtime >= started:
                expiries.append(current)  # a create with a TTL since the sweep listed
        write_atomic(d / NEXT_EXPIRY, repr(min(expiries, default=0.0)))
    (d / SWEPT).touch()
