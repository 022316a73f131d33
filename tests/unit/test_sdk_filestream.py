"""``Sandbox.read_stream`` / ``write_stream`` on a backend whose handle has no
``FileStreams`` (a microVM's): the fallback holds the whole file and goes through
``read_file`` / ``write_file`` at ``commit``, as the lock's user only. The streaming path on
real sandboxes: ``tests/integration/test_sdk_filestream.py``."""

from __future__ import annotations

import pytest

from envbuild.errors import BackendUnavailable, RuntimeShimError
from envbuild.store import LocalStore
from runtime_shim.backends import base as registry
from runtime_shim.backends.base import FileStreams
from runtime_shim.backends.fake import FakeBackend, fake_lock
from runtime_shim.sdk.filestream import BufferedWriter
from runtime_shim.sdk.sandbox import Sandbox


@pytest.fixture
def sb(tmp_path):
    fb = FakeBackend()
    registry.register("fake", fb)
    store = LocalStore(tmp_path / "store")
    fake_lock(store)
    try:
        with Sandbox.create("env/fake", store=store, node_dir=tmp_path / "node",
                            backend="fake") as sandbox:
            yield sandbox, fb
    finally:
        registry.unregister("fake")


def test_the_fallback_writes_at_commit_and_reads_the_whole_file(sb):
    sandbox, fb = sb
    assert not isinstance(sandbox.handle, FileStreams)
    with sandbox.write_stream("/f") as w:
        assert isinstance(w, BufferedWriter)
        w.write(b"a")
        w.write(memoryview(b"bc"))
        assert fb.calls["write_file"] == 0 and w.written == 3
    assert fb.calls["write_file"] == 1
    with sandbox.read_stream("/f") as f:
        assert f.read(2) == b"ab" and f.read() == b"c"
    with pytest.raises(ValueError):
        with sandbox.write_stream("/f") as w:
            w.write(b"never")
            raise ValueError
    assert fb.calls["write_file"] == 1 and sandbox.read_file("/f") == b"abc"
    with pytest.raises(RuntimeShimError, match="has ended"):
        w.write(b"late")


def test_the_fallback_refuses_another_owner(sb):
    sandbox, _ = sb
    with pytest.raises(BackendUnavailable, match="lock's user"):
        sandbox.write_stream("/g", user="0:0")
    sandbox.write_stream("/g", user="1000").abort()  # the lock's own user (1000:1000) is fine
