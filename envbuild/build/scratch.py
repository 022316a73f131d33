"""A build's scratch dir, owned while the build lives (side effects).

Each scratch dir ``<root>/<id>`` has an owner file ``<root>/<id>.owner`` that the build holds
``flock``ed for its whole life (the kernel drops the lock when the process dies, however it
dies); ``envbuild.build.reaper`` removes the dirs whose owner file it can lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from envbuild.safefs import remove_tree

OWNER_SUFFIX = ".owner"


def claim_scratch(root: Path, name: str) -> tuple[Path, int]:
    """A new scratch dir ``root/name`` and the fd of its owner file, flocked for as long as the
    fd is open. The owner file is locked before it gets its final name (a sweeper never sees
    an owner file nobody holds yet) and exists before the dir (a dir without one is not ours)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}{OWNER_SUFFIX}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"%d\n" % os.getpid())  # for people looking; the lock is what counts
    os.rename(tmp, root / f"{name}{OWNER_SUFFIX}")
    scratch = root / name
    scratch.mkdir()
    return scratch, fd


def release_scratch(scratch: Path, owner: int) -> None:
    """Remove a finished build's scratch dir, then its owner file. If removal fails the owner
    file stays and, unlocked once ``owner`` is closed, the next sweep retries."""
    try:
        remove_tree(scratch)
        os.unlink(f"{scratch}{OWNER_SUFFIX}")
    except OSError:
        pass
    finally:
        os.close(owner)
