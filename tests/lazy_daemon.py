"""A bare node daemon (``python -m runtime_shim.lazyfs --node DIR``: no mounts) for tests that
talk to its control socket: started from this checkout, waited for until it answers a ping,
terminated at the end."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from runtime_shim.lazyfs.control import daemon_request

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def bare_daemon(node: Path, timeout: float = 20.0) -> Iterator[subprocess.Popen[bytes]]:
    """Start the daemon of node cache ``node`` (created), yield it once it answers a ping
    (within ``timeout`` seconds; its stderr, kept in ``node/daemon.stderr``, is the failure's
    message), and stop it."""
    node.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(node / "daemon.stderr", "wb") as err:
        daemon = subprocess.Popen([sys.executable, "-m", "runtime_shim.lazyfs", "--node",
                                   str(node)], env=env, cwd="/", stdout=subprocess.DEVNULL,
                                  stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while daemon_request(node, {"op": "ping"}, 5) is None:
            assert daemon.poll() is None, (node / "daemon.stderr").read_text()
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.05)
        yield daemon
    finally:
        daemon.terminate()
        daemon.wait(20)
