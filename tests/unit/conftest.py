"""Unit tests: pure code only. No network (enforced here), no subprocess (enforced for the whole
fast tier, tests/conftest.py), tmp files allowed."""

from __future__ import annotations

import socket

import pytest

from runtime_shim.sdk import exitwatch


@pytest.fixture(autouse=True)
def _no_side_effects(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unit tests must not open sockets: such a test belongs in the "
                             "integration tier (mark it `integration`, docs/testing.md)")

    # a sandbox's create starts its process's exit watcher (a process): not for fakes
    monkeypatch.setattr(exitwatch, "watch", lambda node_root: None)
    monkeypatch.setattr(socket.socket, "connect", refuse)
