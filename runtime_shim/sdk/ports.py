"""Inbound ports: a socket connected to a port that a process listens on inside a sandbox.

A container sandbox has its own network namespace (``/proc/<init>/ns/net``; without
``network=`` it holds only ``lo``). ``connect`` joins that namespace on a short-lived thread
(``runtime_shim.backends.criu.in_netns``) and connects to ``127.0.0.1:PORT`` there; the socket
stays in the sandbox's namespace for its whole life while the caller uses it from the host.
Nothing changes in the sandbox: no agent request, no listener on the host, no firewall rule
(the connection is the sandbox's own loopback, which its firewall always allows), so it works
with ``network=False`` too. A server must listen on ``127.0.0.1`` or on every address
(``0.0.0.0``, ``::`` with dual stack).
"""

from __future__ import annotations

import os
import socket
from typing import Protocol

from envbuild.errors import BackendUnavailable, PortRefused, RuntimeShimError, SandboxNotFound
from runtime_shim.backends.criu import in_netns

#: Seconds ``connect`` waits for the connection by default.
CONNECT_TIMEOUT = 10.0


class _Target(Protocol):
    """What this module reads of a ``Sandbox`` (a protocol, not an import back)."""

    @property
    def id(self) -> str: ...

    @property
    def backend(self) -> str: ...

    @property
    def host_pid(self) -> int | None: ...


def netns_path(sandbox: _Target) -> str:
    """``/proc/<init>/ns/net`` of a container sandbox: its own network namespace. Refused for
    another backend (a microVM's ports are in its guest, not in QEMU's namespace) and for a
    namespace that is this process's own (it would reach the host's ports)."""
    if sandbox.backend != "container":
        raise BackendUnavailable(f"ports of a {sandbox.backend} sandbox cannot be reached yet",
                                 hint="use the container backend (runc) for inbound ports")
    pid = sandbox.host_pid
    path = f"/proc/{pid}/ns/net"
    try:
        theirs = os.stat(path)
    except (OSError, TypeError) as e:
        raise SandboxNotFound(f"sandbox {sandbox.id} is not running ({path}: {e})",
                              hint="envbuild sandbox ls shows its state") from e
    ours = os.stat("/proc/self/ns/net")
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        raise RuntimeShimError(f"sandbox {sandbox.id} shares the host's network namespace: "
                               "its ports would be the host's", hint="this is a bug: report it")
    return path


def check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise RuntimeShimError(f"port {port!r} is not a TCP port", hint="give 1 to 65535")
    return port


def connect(sandbox: _Target, port: int, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """A blocking TCP socket connected to ``127.0.0.1:port`` inside ``sandbox``;
    ``PortRefused`` (a ``ConnectionRefusedError`` too) when nothing listens there."""
    port = check_port(port)
    path = netns_path(sandbox)

    def make() -> socket.socket:
        return socket.create_connection(("127.0.0.1", port), timeout=timeout)

    try:
        sock = in_netns(path, make)
    except ConnectionRefusedError as e:
        raise PortRefused(f"nothing listens on port {port} in sandbox {sandbox.id}",
                          hint="start the server first; it must listen on 127.0.0.1 or "
                               "0.0.0.0 inside the sandbox") from e
    except TimeoutError as e:
        raise RuntimeShimError(f"connect to port {port} in sandbox {sandbox.id}: no answer "
                               f"in {timeout:g} s", hint="is the server in the sandbox "
                                                         "stuck or overloaded?") from e
    except OSError as e:
        raise RuntimeShimError(f"connect to port {port} in sandbox {sandbox.id}: "
                               f"{e.strerror or e}") from e
    sock.settimeout(None)
    return sock
