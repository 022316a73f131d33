"""``envbuild serve`` for tests: the real CLI in its own process on 127.0.0.1 (a free port),
over a store and node dir of the test's, with an API key file; stopped with SIGTERM after,
and (``--on-exit kill``, the default here) checked to have left no sandbox, mount or process
behind."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO

API_KEY = "e2b_test_key_0123456789"
#: The template the e2b tests create sandboxes of: the busybox env ``e2b_built`` builds.
TEMPLATE = "busybox-shell"


@dataclasses.dataclass
class Server:
    url: str
    api_key: str
    proc: subprocess.Popen

    def env(self) -> dict[str, str]:
        """The three variables an e2b client needs, and nothing else."""
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url,
                "E2B_API_KEY": self.api_key}


@contextlib.contextmanager
def running_server(root: Path, store: Path, node: Path, *, keys: str | None = None,
                   args: tuple[str, ...] = (), on_exit: str = "kill") -> Iterator[Server]:
    """``envbuild serve --listen 127.0.0.1:0 --api-keys FILE --on-exit ON_EXIT`` until the
    block ends (or the test stops it: ``proc``); with ``kill``, nothing may be left after."""
    keyfile = root / "api-keys"
    keyfile.write_text(keys if keys is not None else f"# test keys\n{API_KEY}\n")
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(node), "ENVBUILD_STORE": str(store),
           "PYTHONPATH": str(REPO)}
    log = (root / "serve.log").open("w+b")
    proc = subprocess.Popen([sys.executable, "-m", "envbuild.cli", "serve", "--listen",
                             "127.0.0.1:0", "--api-keys", str(keyfile), "--on-exit", on_exit,
                             *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = _wait_url(root / "serve.log", proc)
        yield Server(url=url, api_key=API_KEY, proc=proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    if proc.returncode == -signal.SIGKILL:  # the test killed it
        return
    assert proc.returncode == 0, (root / "serve.log").read_text()[-3000:]
    if on_exit == "keep":
        return
    from runtime_shim import list_sandboxes
    from tests.leftovers import assert_nothing_left_under

    assert list_sandboxes(node) == [], "envbuild serve left sandboxes behind"
    assert_nothing_left_under(node)


def _wait_url(log: Path, proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if m := re.search(r"envbuild serve: (http://127\.0\.0\.1:\d+)", text):
            return m.group(1)
        if proc.poll() is not None:
            raise AssertionError(f"envbuild serve exited {proc.returncode}: {text[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"envbuild serve printed no URL in {timeout} s")


@contextlib.contextmanager
def e2b_env(server: Server) -> Iterator[None]:
    """``os.environ`` with the server's three variables for the block (the SDK reads them)."""
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def assert_run_times_out(sandbox) -> None:
    """An e2b SDK ``commands.run`` past its timeout raises ``TimeoutException`` within seconds,
    and the command is ended with its deadline (gone from ``commands.list()``), not left running."""
    import pytest
    from e2b import TimeoutException

    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 10
    while sandbox.commands.list() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox.commands.list() == []
