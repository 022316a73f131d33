"""What a test left on the host under one directory: mounts, loop devices, processes.

``leftovers_under(path)`` is what tests that build or kill builders assert empty at the end: a
mount at or below ``path`` (this mount namespace), a loop device whose backing file is below it
(also an unlinked one, ``(deleted)``), and a process other than this one whose command line or
mount table names it (a build step's container runs in its own mount namespace, so its
``/proc/PID/root`` says ``/``; its mount table still names the overlay's dirs).
"""

from __future__ import annotations

import os
from pathlib import Path


def mounts_under(path: Path) -> list[str]:
    from runtime_shim.isolation.mount import mounted_targets_under

    return mounted_targets_under(str(path))


def loops_under(path: Path) -> list[str]:
    from envbuild.build.reaper import loops_backed_under

    return loops_backed_under(path)


def processes_under(path: Path) -> list[str]:
    """``"PID CMDLINE"`` of every other process whose command line or mount table names
    ``path`` (or a path below it)."""
    want = str(path).rstrip("/").encode()
    me = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry.name}/mountinfo", "rb") as f:
                mountinfo = f.read()
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if want + b"/" in cmdline or cmdline.rstrip(b"\0").endswith(want) or want + b"/" in mountinfo:
            args = cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]
            found.append(f"{entry.name} {args}")
    return found


def leftovers_under(path: Path) -> dict[str, list[str]]:
    """Mounts, loop devices and processes under ``path``; empty lists when nothing is left."""
    return {"mounts": mounts_under(path), "loop devices": loops_under(path),
            "processes": processes_under(path)}


def assert_nothing_left_under(path: Path) -> None:
    left = leftovers_under(path)
    assert left == {"mounts": [], "loop devices": [], "processes": []}, left
