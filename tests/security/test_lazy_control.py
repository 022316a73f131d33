"""The lazy layer daemon's control socket (``runtime_shim.lazyfs.control``) is an abstract Unix
socket: any local process in the host's network namespace can connect to it. A client that
sends an endless request line must not make the real daemon buffer it (issue 11's resource-bomb
review found the unbounded line read): the daemon refuses the line once it passes
``MAX_MESSAGE``, its memory stays bounded, and it keeps serving other clients."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from runtime_shim.lazyfs.control import MAX_MESSAGE, daemon_address, daemon_request
from tests.lazy_daemon import bare_daemon

FLOOD = 3 * MAX_MESSAGE  # 96 MiB without a newline


def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_an_endless_request_line_is_refused_with_bounded_memory(tmp_path):
    node = tmp_path / "node"
    with bare_daemon(node) as daemon:
        before = _hwm_mib(daemon.pid)
        # keep the daemon from exiting idle while we flood: a second, silent connection
        keeper = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        keeper.connect(daemon_address(node))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        sock.connect(daemon_address(node))
        chunk = b"x" * (1 << 20)
        sent, t0 = 0, time.monotonic()
        try:
            while sent < FLOOD:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before we were done: the point
        reply = b""
        try:
            reply = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            pass
        sock.close()
        elapsed = time.monotonic() - t0
        assert sent < FLOOD, "the daemon read the whole flood"
        if reply:
            msg = json.loads(reply)
            assert msg["ok"] is False and "longer than" in msg["error"]
        assert elapsed < 20
        assert _hwm_mib(daemon.pid) - before < 100, "the daemon buffered the flood"
        pong = daemon_request(node, {"op": "ping"}, 5)
        assert pong is not None and pong["pid"] == daemon.pid
        keeper.close()
