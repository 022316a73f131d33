"""pack-diff policy and gc through ``Sandbox`` over ``FakeBackend`` (no runc)."""

from __future__ import annotations

import json
import os

import pytest

from envbuild.errors import BackendUnavailable, SnapshotRefused
from envbuild.store import LocalStore
from runtime_shim.backends import base as registry
from runtime_shim.backends.fake import FakeBackend, fake_lock
from runtime_shim.node.locks import resolve
from runtime_shim.node.packdiff import SnapshotPolicy
from runtime_shim.sdk.sandbox import Sandbox, gc_sandboxes, list_sandboxes


@pytest.fixture
def env(tmp_path):
    store = LocalStore(tmp_path / "store")
    fake_lock(store)
    fb = FakeBackend()
    registry.register("fake", fb)
    yield store, tmp_path / "node", fb
    registry.unregister("fake")


def test_pack_diff_quiesces_packs_and_publishes(env):
    store, node, fb = env
    with Sandbox.create("env/fake", store=store, node_dir=node, backend="fake") as sb:
        upper = sb.handle.upper_dir()
        (upper / "workspace").mkdir()
        (upper / "workspace" / "out.txt").write_text("result\n")
        result = sb.pack_diff("snap/one")
        assert fb.calls["quiesce"] == 1 and sb.handle.quiesced == 0
    lock = resolve(store, "snap/one")
    assert [layer.digest for layer in lock.layers] == [result.layer]
    assert result.lock == lock.digest


def test_pack_diff_policy_refuses_an_oversized_file(env):
    store, node, fb = env
    with Sandbox.create("env/fake", store=store, node_dir=node, backend="fake") as sb:
        upper = sb.handle.upper_dir()
        (upper / "big").write_bytes(b"x" * 4096)
        with pytest.raises(SnapshotRefused):
            sb.pack_diff("snap/big", policy=SnapshotPolicy(max_file_bytes=1024))
        assert sb.handle.quiesced == 0  # quiesce undone on the way out
    assert "snap/big" not in store.list_refs()


def test_a_handle_without_the_snapshot_capability_is_refused(env):
    store, node, fb = env

    class NoSnapshots:
        def __init__(self, inner):
            self._inner = inner
            self.id, self.limits = inner.id, inner.limits

        def __getattr__(self, name):
            if name in ("quiesce", "upper_dir"):
                raise AttributeError(name)
            return getattr(self._inner, name)

    with Sandbox.create("env/fake", store=store, node_dir=node, backend="fake") as sb:
        sb._backend = NoSnapshots(sb.handle)  # swap the handle: white-box
        with pytest.raises(BackendUnavailable):
            sb.pack_diff()


def test_gc_removes_orphans_not_live_or_kept_ones(env):
    store, node, fb = env
    live = Sandbox.create("env/fake", store=store, node_dir=node, backend="fake")
    kept = Sandbox.create("env/fake", store=store, node_dir=node, backend="fake", keep=True)
    orphan = Sandbox.create("env/fake", store=store, node_dir=node, backend="fake")
    meta = json.loads(orphan.paths.meta.read_text())
    orphan.paths.meta.write_text(json.dumps({**meta, "pid": 999999999}))
    assert gc_sandboxes(node) == [orphan.id]
    assert {s.id for s in list_sandboxes(node)} == {live.id, kept.id}
    assert fb.calls["remove"] == 1
    live.close()
    kept.close()


def test_a_microvm_cannot_be_attached_and_says_why(env, tmp_path):
    store, node, _ = env
    # what a microVM's record looks like on the node (its QEMU is a child of its creator)
    sb = Sandbox.create("env/fake", store=store, node_dir=node, backend="fake")
    meta = json.loads(sb.paths.meta.read_text())
    sb.paths.meta.write_text(json.dumps({**meta, "backend": "microvm"}))
    with pytest.raises(BackendUnavailable) as e:
        Sandbox.attach(sb.id, node_dir=node)
    assert e.value.hint
    assert [s.backend for s in list_sandboxes(node)] == ["microvm"]
    sb.paths.meta.write_text(json.dumps(meta))
    sb.close()
    assert os.listdir(node / "sandboxes") == []
