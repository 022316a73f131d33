"""The node daemon's control socket: its address, the protocol, and the client side.

One process per node cache serves every lazy layer of the host, each as its own FUSE mount
(one libfuse session and loop per mount, in threads of that process): the interpreter, the
imports, the chunk caches and the store connections are paid for once, not once per layer
(``runtime_shim.lazyfs.daemon``). Clients (``NodeCache.ensure_lazy``) talk to it over a Unix
socket in the node's private dir, ``<node>/run/lazyfs.sock`` (``CONTROL_DIR``, ``SOCKET_NAME``).

**Who may talk to whom** (issue 34, item 1: a root daemon that mounts what it is told is root
for whoever can tell it). The daemon runs as root and mounts; so:

- the socket lives in ``<node>/run``, a directory owned by the daemon's user, mode 0700, that
  no other user can enter, create a name in or replace (``private_dir`` checks owner and mode
  on an ``O_NOFOLLOW`` fd, and both sides reach the socket through that fd, never by path);
- the daemon answers only peers whose ``SO_PEERCRED`` uid is root or its own (defence in depth:
  a socket or dir opened up by mistake still serves no one else);
- a client talks only to a daemon whose ``SO_PEERCRED`` uid is root or its own (a name squatted
  by another user is refused, never fed requests), and only through a dir no one else can write;
- the daemon mounts a layer only at ``<node>/lazy/<hex of the digest requested>``, a real dir of
  its own, and never where a request says; clients check every path a reply names against the
  exact pattern it must match, and that the mount it claims is there
  (``runtime_shim.lazyfs.metalayer.meta_dirs``, ``NodeCache.ensure_lazy``).

One daemon per node holds ``<node>/run/lazyfs.lock`` (flock) while it accepts: it alone removes
a stale socket file and binds; on exit it removes the socket, then lets the lock go, so a new
daemon can start at once. A connection carries **one request and one reply, each one line of JSON**
(UTF-8, newline-terminated, at most ``MAX_MESSAGE`` bytes; the daemon gives a client
``REQUEST_TIMEOUT`` seconds to send its request)::

    {"op": "ping"}                                   -> {"ok": true, "pid": P, "mode": M,
                                                         "mode_reason": TEXT,
                                                         "fetch_concurrency": N,
                                                         "fetch_timeout": S,
                                                         "max_requests_in_flight": N,
                                                         "slot_wait": {...},
                                                         "files_fetched": N,
                                                         "boto3_loaded": B, ...}
    {"op": "mount", "mountpoint": M, "store": URL, "s3_endpoint": E|null, "digest": D,
     "toc_digest": T|null, "size": N|null, "ranges_url": U|null, "timeout": S,
     "profile": {"key", "layers", "store", "s3_endpoint", "put_url"?}|null}
                                                     -> {"ok": true, "pid": P, "mode": M}
                                                     |  {"ok": false, "error": TEXT}
    {"op": "prefetch", "key": K|null, "layers": [{"mountpoint": M, "paths": [PATH, ...]}, ...]}
                                                     -> {"ok": true, "started": N}
    {"op": "stats", "mountpoint": M}                -> {"ok": true, "stats": {...}}
                                                     |  {"ok": false, "error": TEXT}

(A mount's ``M`` must be ``<node>/lazy/<hex of D>``: the daemon mounts nowhere else.)
Any other request, one that is not JSON, or one longer than ``MAX_MESSAGE`` gets
``{"ok": false, "error": TEXT}`` (or the connection closed); it never takes the daemon down.

"mount" opens the layer (footer, TOC: a wrong digest is an error reply, never a mount) and
answers once the kernel's INIT arrived. A mount ends when it is unmounted; the daemon exits
once it has served no mount and no request for ``DAEMON_IDLE_EXIT`` seconds, and on
SIGTERM/SIGINT/SIGHUP it unmounts everything first. "prefetch" (the stack's profile, sent once
all its mounts are up, so it does not slow their opening) loads files of mounted layers in the
background; a mount's "profile" makes the daemon record the layer's reads and save the stack's
profile (``runtime_shim.lazyfs.profile.read_profile``) to the store — with a ``put_url`` (a
presigned PUT of the record, ``Presigner``) without a store client of its own; a "prefetch" naming that
profile's ``key`` (the client found one, read while the mounts were made) stops the saving. A
client that finds no
daemon (connection refused, or reset by one that is exiting) starts one and asks again.

This module imports nothing of the daemon (no FUSE, no store), so ``runtime_shim.node.nodecache``
can use it without loading either.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import struct
from typing import Any

from envbuild.errors import RuntimeShimError

#: The longest request or reply line (a prefetch request lists a stack's profiled files:
#: at most 20,000 paths per layer).
MAX_MESSAGE = 32 << 20
#: Seconds the daemon waits for a client's request line.
REQUEST_TIMEOUT = 30.0

#: Seconds a daemon without mounts or requests waits before it exits.
DAEMON_IDLE_EXIT = 1.0


#: The node's private dir (mode 0700, the daemon's user's): the control socket and its lock.
CONTROL_DIR = "run"
SOCKET_NAME = "lazyfs.sock"
LOCK_NAME = "lazyfs.lock"

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def trusted_uids() -> frozenset[int]:
    """The users a node's daemon and its clients trust: root and this process's own."""
    return frozenset({0, os.geteuid()})


def private_dir(node_root: str | os.PathLike[str], *, create: bool) -> int:
    """A directory fd (opened ``O_NOFOLLOW``) of ``<node_root>/run``, checked: owned by
    a trusted user (``trusted_uids``) and writable by no one else; ``create`` (the daemon) makes
    it (mode 0700) and tightens its mode if it is its own. Raises ``FileNotFoundError`` when it
    (or the node dir) does not exist and ``create`` is false, ``RuntimeShimError`` when it is
    not private. The caller closes the fd."""
    root_fd = os.open(os.fspath(node_root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_owner(root_fd, os.fspath(node_root), others_may_read=True)
        if create:
            try:
                os.mkdir(CONTROL_DIR, 0o700, dir_fd=root_fd)
            except FileExistsError:
                pass
        try:
            fd = os.open(CONTROL_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=root_fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlink or a file in its place
                raise RuntimeShimError(
                    f"lazy daemon dir {os.path.join(os.fspath(node_root), CONTROL_DIR)} is not "
                    "a directory (a symlink or file is in its place)",
                    hint="remove it; only root should write in a node dir") from None
            raise
    finally:
        os.close(root_fd)
    try:
        path = os.path.join(os.fspath(node_root), CONTROL_DIR)
        st = os.fstat(fd)
        if create and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
        _check_owner(fd, path, others_may_read=not create)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_owner(fd: int, path: str, *, others_may_read: bool) -> None:
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    bad = 0o022 if others_may_read else 0o077
    if st.st_uid not in trusted_uids() or mode & bad:
        raise RuntimeShimError(
            f"lazy daemon dir {path} is not private (owner uid {st.st_uid}, mode {mode:o}): "
            "another user could reach or replace the daemon's socket",
            hint="a node dir must belong to root (or the node's owner) and be writable by it "
                 "alone: remove it, or chmod go-w it")


def socket_path(dir_fd: int) -> str:
    """The control socket reached through the private dir's fd: no path lookup another user
    can redirect, and short whatever the node dir's depth (``sun_path`` is 108 bytes)."""
    return f"/proc/self/fd/{dir_fd}/{SOCKET_NAME}"


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of the connected Unix socket ``sock``."""
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid


def daemon_request(node_root: str | os.PathLike[str], req: dict[str, Any],
                   timeout: float) -> dict[str, Any] | None:
    """Send ``req`` to the node daemon and return its reply; ``None`` when no daemon answers
    (none runs, or it is exiting). A daemon socket not in a private dir, or served by another
    user, is a ``RuntimeShimError``: it is never sent a request."""
    try:
        dir_fd = private_dir(node_root, create=False)
    except FileNotFoundError:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(socket_path(dir_fd))
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        uid = peer_uid(sock)
        if uid not in trusted_uids():
            raise RuntimeShimError(
                f"the lazy layer daemon socket of {node_root} is served by uid {uid}, not by "
                "root: refusing to talk to it",
                hint="another user squats the daemon's socket; remove "
                     f"{os.path.join(os.fspath(node_root), CONTROL_DIR, SOCKET_NAME)}")
        try:
            sock.sendall(json.dumps(req).encode() + b"\n")
            reply = _read_line(sock)
        except (BrokenPipeError, ConnectionResetError):
            return None
        except TimeoutError:
            raise RuntimeShimError(f"the lazy layer daemon of {node_root} did not answer "
                                   f"within {timeout:.0f} s") from None
        return json.loads(reply) if reply else None
    finally:
        sock.close()
        os.close(dir_fd)


def daemon_mode(node_root: str | os.PathLike[str], timeout: float = 5.0) -> str | None:
    """How the node daemon serves reads (``"passthrough"`` or ``"fuse"``); ``None`` when no
    daemon answers."""
    reply = daemon_request(node_root, {"op": "ping"}, timeout)
    return str(reply.get("mode") or "fuse") if reply else None


def _read_line(sock: socket.socket, limit: int = MAX_MESSAGE) -> bytes:
    """One newline-terminated line from ``sock`` (or what came before the peer closed), at most
    ``limit`` bytes: a longer one is a ``RuntimeShimError`` before more is buffered (a reply
    is hostile until proven otherwise; see the resource-bomb review)."""
    buf = bytearray()
    while True:
        part = sock.recv(min(65536, limit + 1 - len(buf)))
        if not part:
            return bytes(buf)
        start = len(buf)
        buf += part
        end = buf.find(b"\n", start)
        if end >= 0:
            return bytes(buf[:end + 1])
        if len(buf) > limit:
            raise RuntimeShimError(f"lazy daemon control message longer than {limit} bytes")


class ControlListener:
    """The daemon's side of the socket: ``open`` takes the node's daemon lock and binds
    ``<node>/run/lazyfs.sock`` (mode 0600), or returns ``None`` when another daemon holds the
    lock; ``close`` removes the socket, then lets the lock go (see the module docstring)."""

    def __init__(self, dir_fd: int, lock_fd: int, sock: socket.socket) -> None:
        self.dir_fd, self.lock_fd, self.sock = dir_fd, lock_fd, sock

    @classmethod
    def open(cls, node_root: str | os.PathLike[str], backlog: int = 64) -> ControlListener | None:
        import fcntl

        dir_fd = private_dir(node_root, create=True)
        lock_fd = -1
        try:
            lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600, dir_fd=dir_fd)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock_fd)
                os.close(dir_fd)
                return None
            try:
                os.unlink(SOCKET_NAME, dir_fd=dir_fd)   # a dead daemon's: ours to replace
            except FileNotFoundError:
                pass
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            # the file is created with the socket inode's mode: never connectable by others
            os.fchmod(sock.fileno(), 0o600)
            sock.bind(socket_path(dir_fd))
            sock.listen(backlog)
        except BaseException:
            if lock_fd >= 0:
                os.close(lock_fd)
            os.close(dir_fd)
            raise
        return cls(dir_fd, lock_fd, sock)

    def accept(self) -> tuple[socket.socket, int]:
        """The next connection and its peer's uid (``socket.timeout`` as set on ``sock``)."""
        conn, _ = self.sock.accept()
        return conn, peer_uid(conn)

    def close(self) -> None:
        try:
            os.unlink(SOCKET_NAME, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        self.sock.close()
        os.close(self.lock_fd)
        os.close(self.dir_fd)
