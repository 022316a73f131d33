"""Test hosts in network namespaces a test makes (never an address outside this machine): a
namespace behind one veth pair with addresses the test names, and HTTP servers inside it.
Shared by the network tests (``test_network.py``, ``test_network_reach.py``)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator, Sequence


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@contextlib.contextmanager
def veth_namespace(prefix: str, links: Sequence[tuple[str, str]]) -> Iterator[str]:
    """A new network namespace joined to the host by one veth pair; ``links`` are
    ``(host side CIDR, namespace side CIDR)`` addresses put on its two ends. Yields the
    namespace's name; removes both afterwards and checks they are gone."""
    tag = uuid.uuid4().hex[:6]
    ns, host_if, peer_if = f"eb-{prefix}-{tag}", f"eb{prefix[:1]}{tag}a", f"eb{prefix[:1]}{tag}b"
    _run("ip", "netns", "add", ns)
    try:
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        _run("ip", "link", "set", peer_if, "netns", ns)
        for host_side, ns_side in links:
            _run("ip", "addr", "add", host_side, "dev", host_if)
            _run("ip", "-n", ns, "addr", "add", ns_side, "dev", peer_if)
        _run("ip", "link", "set", host_if, "up")
        _run("ip", "-n", ns, "link", "set", peer_if, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                    text=True).stdout
    assert subprocess.run(["ip", "link", "show", host_if], capture_output=True).returncode != 0


@contextlib.contextmanager
def http_servers(ns: str, bind: str, ports: Sequence[int], body: bytes) -> Iterator[None]:
    """HTTP servers in namespace ``ns`` on ``bind`` (an address, or ``0.0.0.0``), one per port,
    answering every GET with ``body`` (keep-alive: one connection, many answers); ready when
    this enters, killed when it exits."""
    code = textwrap.dedent(f"""
        import http.server, threading
        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            def do_GET(self):
                b = {body!r}
                self.send_response(200); self.send_header("Content-Length", str(len(b)))
                self.end_headers(); self.wfile.write(b)
            def log_message(self, *a): pass
        for p in {list(ports)}:
            s = http.server.ThreadingHTTPServer(({bind!r}, p), H)
            threading.Thread(target=s.serve_forever).start()
        print("ready", flush=True)
    """)
    srv = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        yield
    finally:
        srv.kill()
        srv.wait()
