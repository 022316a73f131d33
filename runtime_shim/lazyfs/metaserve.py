"""The lazy daemon's metadata server: a mount's lookups answered off the daemon's GIL.

Why. The daemon is one Python interpreter. While it fetches (HTTP reads, buffer copies,
frame bookkeeping), every FUSE request of every mount waits for its lock: measured by
``benchmarks/lazy_metadata.py``, a LOOKUP took 18x as long (mean) while the daemon prefetched
as while it was idle, and an agent's workload sends ~4,300 metadata requests to ~1,500 opens.
This process answers the metadata requests from its own copy of each mount's tree, with its
own interpreter; the daemon keeps what needs the file cache and the connection's state.

How (one server per daemon, one thread per mount):

- The daemon starts it at start-up in passthrough mode (``MetaServer.start``) with one end of
  a control socket pair. For each mount, before reading any request, the daemon sends
  (``MetaServer.adopt``) the mount's ``/dev/fuse`` fd, one end of a forwarding socket pair and
  a memfd holding the mount's node table (``fusewire.table_rows``, marshalled; its first page
  is the server's request counters, which the daemon reads for ``requests_by_opcode``).
- The daemon reads the mount's requests itself (INIT first, then whatever comes) until the
  server has built its tree and sends ``READY``: the mount's first lookups (overlayfs, runc)
  do not wait for the hand-over. Both read the file non-blocking (``O_NONBLOCK`` is the open
  file's, shared), so neither is stuck in a read another took the request of.
- The server is then the only reader of that ``/dev/fuse`` file. It answers what
  ``fusewire.MetaTree`` answers and drops FORGETs; every other request (INIT, OPEN, READ,
  RELEASE, the root's stats attribute, ...) goes whole, as read, down the forwarding socket.
  The daemon dispatches it as if it had read it itself, and writes the reply to its own fd of
  the same open file (replies are matched by the request's ``unique``, on the file's
  processing list, whichever process writes them).
- The release of a passthrough file (file handle 0: nothing to close, only the daemon's count
  of the file's opens, which bounds its idle backing ids) is answered here too, and the
  released node ids ride along with the next forwarded request (``RELEASED``), or go alone
  once ``RELEASES_MAX`` wait: a workload's ~1,500 releases are not ~1,500 wake-ups of the
  daemon.
- Each message on the forwarding socket starts with a tag byte: ``REQUEST`` (a request, then
  any released node ids as unsigned 64-bit integers), ``RELEASED`` (node ids only),
  ``READY`` or ``GONE``.
- When the mount goes away (ENODEV), the server sends ``GONE`` on the forwarding socket and
  closes it. A forwarding socket closed without ``GONE`` means the server died: the daemon
  reads the mount's requests itself from then on (logged). The requests the server held at
  that moment are lost, and their callers wait; nothing else does.
- When the daemon goes away (the control socket closes, or ``PR_SET_PDEATHSIG``), the server
  exits at once, so a dead daemon's mounts fail with ENOTCONN as before, never hang.

``$ENVBUILD_LAZY_METASERVER=on`` turns it on; off (the default), the daemon reads every request
itself (``wanted``).
"""

from __future__ import annotations

import array
import ctypes
import errno
import logging
import marshal
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

if __package__:
    from runtime_shim.lazyfs import fusewire as fw
else:   # run by path (``MetaServer.start``): the standard library and this sibling only
    import fusewire as fw  # type: ignore[no-redef]

log = logging.getLogger("envbuild.lazyfs")

METASERVER_ENV = "ENVBUILD_LAZY_METASERVER"
#: The forwarding socket's message tags (module docstring).
REQUEST, RELEASED, GONE, READY = b"Q", b"R", b"G", b"Y"
#: Released node ids the server keeps before it sends them alone.
RELEASES_MAX = 512
#: Largest forwarded request: a read-only mount's requests are headers, names and small
#: structs (writes are refused by the server itself, never forwarded).
FORWARD_MAX = 64 << 10
#: The memfd's first page: one unsigned 64-bit counter per opcode (what the server answered).
COUNTS_BYTES = 4096
_CONTROL_MAX = 64 << 10
PR_SET_PDEATHSIG = 1


def wanted() -> bool:
    """``$ENVBUILD_LAZY_METASERVER=on``. Off by default, as measured (docs/notes/lazy-loading-log.md,
    "Eighth pass"): a LOOKUP beside a busy daemon took ~10x less time with the server, but the
    cold_start workload was no faster (the daemon's time goes to fetched bytes, not to
    metadata), and a cold node's first create 0.04-0.07 s slower."""
    return os.environ.get(METASERVER_ENV, "off").strip().lower() in ("1", "on", "yes")


# -- the daemon's side -----------------------------------------------------------------------

class MetaServer:
    """The daemon's handle on its metadata server process (module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes], control: socket.socket) -> None:
        self.proc, self.control = proc, control
        self._lock = threading.Lock()

    @classmethod
    def start(cls) -> MetaServer | None:
        """Start the server; None (logged) if it cannot start: the daemon then reads every
        request itself."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # by path, without site (-S): it imports the standard library and ``fusewire``
            # only — 30 ms of CPU against 110 ms for the package (``-m``), taken from the
            # first lazy create on a cold node
            proc = subprocess.Popen(
                [sys.executable, "-S", "-E", os.path.abspath(__file__), str(theirs.fileno()),
                 str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        except OSError as e:
            ours.close()
            log.warning("metadata server: cannot start (%s); the daemon answers every "
                        "request", e.strerror)
            return None
        finally:
            theirs.close()
        log.info("metadata server up: pid %d", proc.pid)
        return cls(proc, ours)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe(self) -> dict[str, Any]:
        return {"pid": self.proc.pid, "alive": self.alive}

    def adopt(self, mountpoint: str, fuse_fd: int, nodes: Mapping[str, Any],
              statfs: Mapping[str, int], xattrs_enosys: bool
              ) -> tuple[socket.socket, memoryview] | None:
        """Hand the mount at ``mountpoint`` (its ``/dev/fuse`` fd, not yet read) to the
        server: ``(forwarding socket, the server's request counters)``, or None (logged)
        when it cannot take it, and the caller reads the mount's requests itself."""
        if not self.alive:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        table = marshal.dumps(fw.table_rows(nodes))
        shm = os.memfd_create("envbuild-meta", os.MFD_CLOEXEC)
        try:
            os.ftruncate(shm, COUNTS_BYTES + len(table))
            os.pwrite(shm, table, COUNTS_BYTES)
            counts = memoryview(mmap.mmap(shm, COUNTS_BYTES)).cast("Q")
            head = marshal.dumps(("mount", mountpoint, len(table), bool(xattrs_enosys),
                                  dict(statfs)))
            fds = array.array("i", [fuse_fd, theirs.fileno(), shm])
            with self._lock:
                self.control.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except OSError as e:
            ours.close()
            log.warning("metadata server: cannot take %s (%s); the daemon reads its "
                        "requests", mountpoint, e.strerror)
            return None
        finally:
            theirs.close()
            os.close(shm)
        return ours, counts

    def close(self) -> None:
        self.control.close()   # the server exits when its control socket closes
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the server ------------------------------------------------------------------------------

def _serve_mount(mountpoint: str, fuse_fd: int, fwd: socket.socket, shm: int,
                 head: tuple) -> None:
    """Read the mount's requests until it goes away: answer metadata, forward the rest."""
    _, _, table_len, xattrs_enosys, statfs = head
    clean = False
    try:
        counts = memoryview(mmap.mmap(shm, COUNTS_BYTES)).cast("Q")
        nodes = fw.nodes_of_table(marshal.loads(os.pread(shm, table_len, COUNTS_BYTES)))
        os.ftruncate(shm, COUNTS_BYTES)   # the table is ours now
        tree = fw.MetaTree(nodes, statfs, xattrs_enosys=xattrs_enosys)
        clean = _serve_requests(mountpoint, fuse_fd, fwd, counts, tree)
    except Exception:  # noqa: BLE001 - the daemon takes the mount back (no GONE)
        log.exception("metadata server: serving %s failed; the daemon takes it", mountpoint)
    finally:
        if clean:
            try:
                fwd.send(GONE)
            except OSError:
                pass
        fwd.close()
        os.close(fuse_fd)
        os.close(shm)


def _serve_requests(mountpoint: str, fuse_fd: int, fwd: socket.socket, counts: memoryview,  # noqa: PLR0912  a FUSE request loop: one branch per outcome of a read
                    tree: fw.MetaTree) -> bool:
    """The mount's request loop (``_serve_mount``): True when the mount went away (unmounted),
    False when reading failed otherwise or the daemon did."""
    rbuf = bytearray(fw._BUFSIZE)
    view = memoryview(rbuf)
    released = array.array("Q")   # node ids released since the last forward
    # the daemon read the mount's requests until now (non-blocking, as we do: a request
    # one of us reads is the other's EAGAIN); from here on it reads ours
    poller = select.poll()
    poller.register(fuse_fd, select.POLLIN)
    fwd.send(READY)
    while True:
        try:
            n = os.readv(fuse_fd, (rbuf,))
        except OSError as e:
            if e.errno == errno.EAGAIN:
                poller.poll()
                continue
            if e.errno in (errno.EINTR, errno.ENOENT):
                continue   # ENOENT: the request was interrupted before we read it
            if e.errno != errno.ENODEV:   # ENODEV: unmounted
                log.error("metadata server: fuse read on %s: %s", mountpoint, e.strerror)
            return e.errno == errno.ENODEV
        length, opcode, unique, nodeid = fw._IN_HEADER.unpack_from(rbuf)[:4]
        if opcode in fw._NO_REPLY:
            counts[opcode % fw.OPCODE_SLOTS] += 1
            continue
        body = view[fw._IN_HEADER.size:length]
        if opcode == fw.RELEASE and fw._RELEASE_IN.unpack_from(body)[0] == 0:
            counts[opcode] += 1   # a passthrough file's: only the daemon's count of opens
            released.append(nodeid)
            out = fw.reply_bytes(unique)
            if len(released) >= RELEASES_MAX:
                if not _send(fwd, mountpoint, RELEASED, released):
                    return False
        elif not tree.answers(opcode, nodeid, body):
            if n > FORWARD_MAX:
                out = fw.reply_bytes(unique, error=errno.EROFS)
            else:
                if not _send(fwd, mountpoint, REQUEST, released, view[:n]):
                    return False
                continue
        else:
            counts[opcode % fw.OPCODE_SLOTS] += 1
            out = _answer(mountpoint, tree, opcode, unique, nodeid, body)
        try:
            os.write(fuse_fd, out)
        except OSError as e:   # ENOENT: the request was interrupted; ENODEV: unmounted
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("metadata server: reply on %s: %s", mountpoint, e.strerror)


def _answer(mountpoint: str, tree: fw.MetaTree, opcode: int, unique: int, nodeid: int,
            body: memoryview) -> bytes:
    """The reply to a metadata request the server answers itself (an error reply when the
    answer fails: one bad request must not end the mount)."""
    try:
        return fw.reply_bytes(unique, tree.answer(opcode, nodeid, body))
    except OSError as e:
        return fw.reply_bytes(unique, error=e.errno or errno.EIO)
    except Exception:  # noqa: BLE001 - one bad request must not end the mount
        log.exception("metadata server: request %d on %s", opcode, mountpoint)
        return fw.reply_bytes(unique, error=errno.EIO)


def _send(fwd: socket.socket, mountpoint: str, tag: bytes, released: array.array,
          request: memoryview | None = None) -> bool:
    """One message to the daemon (a tag, the request if any, the released node ids, which
    are then cleared); False when the daemon is gone."""
    parts: list[bytes | memoryview] = [tag] if request is None else [tag, request]
    if released:
        parts.append(memoryview(released).cast("B"))
    try:
        fwd.sendmsg(parts)
    except OSError as e:   # the daemon is gone: so is the mount's state
        log.error("metadata server: forward on %s: %s", mountpoint, e.strerror)
        return False
    del released[:]
    return True


def serve(control: socket.socket) -> int:
    """Take mounts from the daemon until its control socket closes."""
    while True:
        try:
            msg, anc, _flags, _ = control.recvmsg(_CONTROL_MAX, socket.CMSG_SPACE(3 * 4))
        except InterruptedError:
            continue
        except OSError as e:
            log.error("metadata server: control socket: %s", e.strerror)
            return 1
        if not msg:
            return 0   # the daemon is gone: its mounts' connections must end with it
        fds: list[int] = []
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        try:
            head = marshal.loads(msg)
            if not (isinstance(head, tuple) and head[0] == "mount" and len(fds) == 3):
                raise ValueError(f"unexpected message with {len(fds)} fds")
        except (ValueError, EOFError, TypeError, IndexError) as e:
            log.error("metadata server: bad control message: %s", e)
            for fd in fds:
                os.close(fd)
            continue
        fuse_fd, fwd_fd, shm = fds
        fwd = socket.socket(fileno=fwd_fd)
        threading.Thread(target=_serve_mount, args=(head[1], fuse_fd, fwd, shm, head),
                         name=f"meta-{os.path.basename(head[1])}", daemon=True).start()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s lazyfs-meta[%(process)d] %(levelname)s %(message)s")
    control_fd, parent = int(argv[0]), int(argv[1])
    # not envbuild.libc: run by path (``MetaServer.start``), this process has the standard
    # library and its sibling only
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:   # the daemon died before the line above
        return 0
    # the daemon's signals are its own: a terminal's ^C reaches the process group, and the
    # daemon unmounts (the mounts' ENODEV ends this server's threads, its exit the server)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    return serve(socket.socket(fileno=control_fd))


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    os._exit(code)   # now: the mounts' threads hold their fds until the process is gone
