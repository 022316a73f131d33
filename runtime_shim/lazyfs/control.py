"""The node daemon's control socket: its address, the protocol, and the client side.

One process per node cache serves every lazy layer of the host, each as its own FUSE mount
(one libfuse session and loop per mount, in threads of that process): the interpreter, the
imports, the chunk caches and the store connections are paid for once, not once per layer
(``runtime_shim.lazyfs.daemon``). Clients (``NodeCache.ensure_lazy``) talk to it over a Unix
socket in the abstract namespace (``daemon_address``: no socket file to go stale; it vanishes
with the process). A connection carries **one request and one reply, each one line of JSON**
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

This module imports nothing of the daemon (no FUSE, no store), so ``runtime_shim.nodecache``
can use it without loading either.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from typing import Any

from envbuild.errors import RuntimeShimError

#: The longest request or reply line (a prefetch request lists a stack's profiled files:
#: at most 20,000 paths per layer).
MAX_MESSAGE = 32 << 20
#: Seconds the daemon waits for a client's request line.
REQUEST_TIMEOUT = 30.0

#: Seconds a daemon without mounts or requests waits before it exits.
DAEMON_IDLE_EXIT = 1.0


def daemon_address(node_root: str | os.PathLike[str]) -> bytes:
    """The abstract Unix socket address of the daemon of node cache ``node_root``."""
    key = hashlib.sha256(os.fsencode(os.path.abspath(node_root))).hexdigest()[:32]
    return b"\0envbuild-lazyfs-" + key.encode()


def daemon_request(node_root: str | os.PathLike[str], req: dict[str, Any],
                   timeout: float) -> dict[str, Any] | None:
    """Send ``req`` to the node daemon and return its reply; ``None`` when no daemon answers
    (none runs, or it is exiting)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(daemon_address(node_root))
        except (ConnectionRefusedError, FileNotFoundError):
            return None
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


def daemon_mode(node_root: str | os.PathLike[str], timeout: float = 5.0) -> str | None:
    """How the node daemon serves reads (``"passthrough"`` or ``"fuse"``); ``None`` when no
    daemon answers."""
    reply = daemon_request(node_root, {"op": "ping"}, timeout)
    return str(reply.get("mode") or "fuse") if reply else None


def _read_line(sock: socket.socket, limit: int = MAX_MESSAGE) -> bytes:
    """One newline-terminated line from ``sock`` (or what came before the peer closed), at most
    ``limit`` bytes: a longer one is a ``RuntimeShimError`` before more is buffered (the
    socket is open to any local process; see the resource-bomb review)."""
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
