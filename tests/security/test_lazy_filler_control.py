"""The native filler's control socket (``runtime_shim.lazyfs.filler``, ``native.filler_request``)
against the local users of a node: the removed FUSE daemon's control-channel tests (issue 34)
ported to the filler (issue 36). Whoever talks to the filler can make it fetch and write into
the node's object store, so only root may. Where the filler stands on the rest of those
tests: docs/lazy-loading.md ("What holds"). The attacker
is a real process running as uid 65534 (Debian's ``/usr/bin/python3``, stdlib only)."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.lazyfs import native
from runtime_shim.lazyfs.filler import MAX_REQUEST, SOCKET
from tests.conftest import require_root, require_tool

NOBODY = 65534
ATTACKER_PYTHON = "/usr/bin/python3"


def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def filler_node(tmp_path):
    """A node root on this disk (pre-content marks need ext4/xfs/btrfs) with its filler up;
    afterwards the filler is stopped and gone."""
    require_root()
    root = tmp_path / "node"
    root.mkdir(mode=0o700)
    ping = native.ensure_filler(str(root))
    yield root, ping
    native.shutdown(str(root))
    assert native.filler_request(str(root), {"op": "ping"}, 1.0) is None


@pytest.fixture
def open_dir():
    """A directory every user may traverse (0755; pytest's tmp dirs are 0700)."""
    require_root()
    d = Path(tempfile.mkdtemp(prefix="envbuild-sec-"))
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False)


def test_a_filler_socket_served_by_another_user_is_never_sent_a_request(open_dir):
    """The client checks whom it talks to (``SO_PEERCRED``): a socket at the filler's name
    bound by uid 65534 (planted by a mistake of root's) gets no request; the error says so."""
    require_tool(ATTACKER_PYTHON)
    root = open_dir / "node"
    (root / "objects").mkdir(parents=True, mode=0o700)
    theirs = open_dir / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    listen = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1] + "/s")
s.listen(4)
print("bound", flush=True)
c, _ = s.accept()
open(sys.argv[1] + "/heard", "w").write(c.recv(1 << 16).decode(errors="replace"))
"""
    squatter = subprocess.Popen([ATTACKER_PYTHON, "-c", listen, str(theirs)], user=NOBODY,
                                group=NOBODY, extra_groups=[], cwd="/", stdout=subprocess.PIPE,
                                env={"PATH": "/usr/bin:/bin"})
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == b"bound\n"
        os.rename(theirs / "s", root / "objects" / SOCKET)
        with pytest.raises(RuntimeShimError, match="is not root's"):
            native.filler_request(str(root), {"op": "place", "layer": "x"}, 5)
        squatter.wait(10)   # it accepted, then read EOF: nothing was sent
        assert (theirs / "heard").read_text() == ""
    finally:
        squatter.kill()
        squatter.wait()


def test_an_endless_request_line_is_refused_with_bounded_memory(filler_node):
    """A request line past ``MAX_REQUEST`` without a newline is not buffered whole: the
    worker answers an error and stays up, its memory bounded."""
    root, ping = filler_node
    worker = ping["pid"]
    before = _hwm_mib(worker)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(root / "objects" / SOCKET))
    sock.settimeout(30)
    chunk, flood = b"x" * (1 << 20), 96 * MAX_REQUEST
    sent, t0 = 0, time.monotonic()
    try:
        while sent < flood:
            sock.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass   # refused before we were done: the point
    reply = b""
    try:
        reply = sock.recv(65536)
    except (ConnectionResetError, TimeoutError):
        pass
    sock.close()
    assert sent < flood, "the filler read the whole flood"
    assert reply == b"" or b'"ok": false' in reply, reply
    assert time.monotonic() - t0 < 20
    assert _hwm_mib(worker) - before < 50, "the filler buffered the flood"
    again = native.filler_request(str(root), {"op": "ping"}, 5)
    assert again is not None and again["pid"] == worker   # root is still served
