"""envbuild: upstream's PTY tests against a ``--fleet`` server (./conftest.py)."""

from tests.integration.e2b_upstream.fleet import upstream

globals().update(upstream(
    "sync.pty.test_pty", "sync.pty.test_send_input", "sync.pty.test_resize",
    "sync.pty.test_pty_kill", "sync.pty.test_pty_connect"))
