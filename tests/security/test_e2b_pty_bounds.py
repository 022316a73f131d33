"""``envbuild serve``: a PTY's output has no cap of its own (it is a stream), so a client that
opens a PTY printing without end and never reads its stream must not make the server hold
that output: the stream's backlog is cut at ``Limits.output_bytes`` (the stream ends with an
error, the command runs on) and the server's memory stays bounded. Real server, real SDK,
real runc sandbox."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.e2b_server import e2b_env, running_server
from tests.integration.conftest import build_busybox_env

pytestmark = pytest.mark.slow


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _wait_for_cut(srv, sandbox_id: str, pid: int, timeout: float = 60) -> None:
    """Until the server's log of the sandbox (E2B's logs endpoint) says it cut ``pid``'s
    stream."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{srv.url}/v2/sandboxes/{sandbox_id}/logs",
                      headers={"X-API-KEY": srv.api_key}, params={"search": "was cut"})
        r.raise_for_status()
        if any(e["fields"].get("pid") == str(pid) for e in r.json()["logs"]):
            return
        time.sleep(0.2)
    raise AssertionError(f"the server did not cut the unread stream within {timeout} s")


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
            started = time.monotonic()
            flood = sb.pty.create(PtySize(24, 80), timeout=0)  # its stream is never read
            sb.pty.send_stdin(flood.pid, b"yes xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n")
            # yes prints as fast as the server takes it while nobody reads: the backlog is
            # cut at the cap (the sandbox's log says when), after which the server's memory
            # stops growing
            _wait_for_cut(srv, sb.sandbox_id, flood.pid)
            took = time.monotonic() - started
            first = _rss(srv.proc.pid) - before
            # watched twice as long as the cut took: output kept after the cut would grow by
            # about two caps in that time, a quarter of it kept by half a cap (at least 4 s)
            time.sleep(max(4.0, 2 * took))
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
