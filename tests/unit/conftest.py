"""Unit tests: pure code only. No subprocess, no network (enforced here), tmp files allowed."""

from __future__ import annotations

import socket
import subprocess

import pytest

from runtime_shim.sdk import exitwatch


@pytest.fixture(autouse=True)
def _no_side_effects(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unit tests must not spawn processes or open sockets; "
                             "move this test to tests/integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    # a sandbox's create starts its process's exit watcher (a process): not for fakes
    monkeypatch.setattr(exitwatch, "watch", lambda node_root: None)
    monkeypatch.setattr(socket.socket, "connect", refuse)
