"""A watcher that removes a process's sandboxes when the process dies without closing them.

``runtime_shim.isolation.lifecycle`` closes a process's sandboxes at a normal exit. A process killed
(SIGKILL, the OOM killer, ``os._exit``) runs no hook, and its sandboxes would stay until the
next create on the node or ``envbuild sandbox gc``. So the first create of a process starts
one watcher process for it (``watch``; one per creating process, whatever the number of
sandboxes or node dirs):

- it is the owner's child in a session of its own (a terminal's Ctrl-C or a job-control
  signal to the owner's group does not reach it), with stdin a pipe from the owner and
  stdout/stderr on ``/dev/null`` (it holds no pipe a caller of the owner reads to EOF);
- it waits on a pidfd of the owner (``pidfd_open`` before it checks that the owner is still
  its parent, so a reused pid is never watched), and reads from stdin the node dirs the
  owner creates sandboxes in (one absolute path a line, told before the first create there);
- when the owner is gone it removes, on each of those nodes, every sandbox whose record
  names the owner's pid, was created before the owner died and is not kept
  (``runtime_shim.sdk.sandbox.sweep_sandboxes(dead_owner=...)``), then exits.

It costs one idle Python process per creating process (about 10 MB, no CPU), started
without waiting for it. If the watcher itself is killed with its owner (a kill of the whole
cgroup), the next create on the node or ``envbuild sandbox gc`` removes what is left, as
before.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

#: The package root the watcher imports ``runtime_shim`` from (this checkout or install).
_ROOT = str(Path(__file__).resolve().parents[2])  # the dir holding runtime_shim
_BOOT = (f"import sys; sys.path.insert(0, {_ROOT!r}); "
         "from runtime_shim.sdk.exitwatch import main; main(int(sys.argv[1]))")

_guard = threading.Lock()
_watcher: tuple[int, subprocess.Popen[bytes]] | None = None  # (owner pid, watcher)
_told: set[str] = set()


def watch(node_root: str | os.PathLike[str]) -> None:
    """Make sure this process has a watcher that knows ``node_root`` (call before the first
    create there). Never raises: without a watcher a killed owner's sandboxes are removed by
    the next create or gc, as before."""
    global _watcher
    node = os.path.abspath(node_root)
    with _guard:
        pid = os.getpid()
        if _watcher is None or _watcher[0] != pid or _watcher[1].poll() is not None:
            _told.clear()
            try:
                _watcher = (pid, _spawn(pid))
            except OSError:
                _watcher = None
                return
        if node in _told:
            return
        stdin: IO[bytes] | None = _watcher[1].stdin
        try:
            assert stdin is not None
            stdin.write(os.fsencode(node) + b"\n")
            stdin.flush()
        except OSError:  # it died: the next create starts another
            return
        _told.add(node)


def _spawn(owner: int) -> subprocess.Popen[bytes]:
    # -P: the cwd ("/") is not put on sys.path; the package root is, by _BOOT
    return subprocess.Popen([sys.executable, "-P", "-c", _BOOT, str(owner)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True, start_new_session=True, cwd="/")


def main(owner: int) -> None:
    """The watcher process: wait for ``owner`` to die, then remove its sandboxes."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        pidfd = -1
    nodes: list[str] = []
    pending = b""
    stdin = sys.stdin.fileno()
    if pidfd >= 0 and os.getppid() == owner:  # else it died (or was reaped) already
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(stdin, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if pidfd in ready:
                break
            chunk = os.read(stdin, 1 << 16)
            if not chunk:  # the owner closed the pipe (it exits): only its death counts
                poller.unregister(stdin)
            pending = _take_lines(pending + chunk, nodes)
    died = time.time()
    fcntl.fcntl(stdin, fcntl.F_SETFL, fcntl.fcntl(stdin, fcntl.F_GETFL) | os.O_NONBLOCK)
    with contextlib.suppress(OSError):  # what the owner told just before it died
        while chunk := os.read(stdin, 1 << 16):
            pending = _take_lines(pending + chunk, nodes)
    _take_lines(pending + b"\n", nodes)
    from runtime_shim.sdk.sweep import sweep_sandboxes

    for node in nodes:
        with contextlib.suppress(Exception):  # what fails stays for gc
            sweep_sandboxes(node, dead_owner=owner, now=died)


def _take_lines(data: bytes, into: list[str]) -> bytes:
    """Append each complete line of ``data`` (a node dir) to ``into``; return the rest."""
    *lines, rest = data.split(b"\n")
    into.extend(os.fsdecode(line) for line in lines if line and os.fsdecode(line) not in into)
    return rest


def stop() -> None:
    """Stop this process's watcher: its sandboxes are then left when it dies, as they were
    before there was one (``envbuild sandbox gc`` or the next create removes them). For tests
    of that path: the owner and its watcher killed together, e.g. with their cgroup."""
    global _watcher
    with _guard:
        if _watcher is not None and _watcher[0] == os.getpid():
            _watcher[1].kill()
            _watcher[1].wait()
        _watcher = None
        _told.clear()
