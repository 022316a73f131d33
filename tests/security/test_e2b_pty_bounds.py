"""``envbuild serve``: a PTY's output has no cap of its own (it is a stream), so a client that
opens a PTY printing without end and never reads its stream must not make the server hold
that output: the stream's backlog is cut at ``Limits.output_bytes`` (the stream ends with an
error, the command runs on) and the server's memory stays bounded. Real server, real SDK,
real runc sandbox."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2b_server import e2b_env, running_server
from tests.integration.conftest import build_busybox_env

pytestmark = pytest.mark.slow


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_an_unread_pty_stream_is_cut_not_buffered(tmp_path):
    from e2b import Sandbox, SandboxException
    from e2b.sandbox.commands.command_handle import PtySize

    from runtime_shim.node.model import Limits

    cap = Limits().output_bytes
    store, node = build_busybox_env(tmp_path)
    with running_server(tmp_path, store.root, node) as srv, e2b_env(srv):
        sb = Sandbox.create("busybox-shell", timeout=120)
        try:
            before = _rss(srv.proc.pid)
            flood = sb.pty.create(PtySize(24, 80), timeout=0)  # its stream is never read
            sb.pty.send_stdin(flood.pid, b"yes xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n")
            # yes prints as fast as the server takes it while nobody reads: the backlog is
            # cut at the cap, after which the server's memory stops growing
            time.sleep(8)
            first = _rss(srv.proc.pid) - before
            time.sleep(8)
            later = _rss(srv.proc.pid) - before - first
            assert first < 4 * cap and later < cap // 2, \
                f"the server grew {first >> 20} MiB, then {later >> 20} MiB more"
            # the command runs on; a new stream follows it
            again = sb.pty.connect(flood.pid, timeout=0)
            assert sb.pty.kill(flood.pid)
            with pytest.raises(SandboxException, match="fell .* bytes of output behind"):
                flood.wait()
            del again
            assert sb.commands.run("echo alive").stdout == "alive\n"
        finally:
            sb.kill()
