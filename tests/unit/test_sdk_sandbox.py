"""``Sandbox`` over ``FakeBackend``: create/exec/close/ttl/attach, errors, the registry, gc."""

from __future__ import annotations

import os
import time

import pytest

from envbuild.errors import (
    BackendUnavailable,
    ExecTimeout,
    LockNotFound,
    RefNotFound,
    RuntimeShimError,
    SandboxClosed,
    SandboxNotFound,
)
from envbuild.store import LocalStore
from runtime_shim.backends import base as registry
from runtime_shim.backends.base import Backend, SandboxHandle, Snapshottable
from runtime_shim.backends.fake import FakeBackend, FakeReply, fake_lock
from runtime_shim.node.layout import LAYOUT_VERSION, NodeLayout
from runtime_shim.sdk.sandbox import Sandbox, list_sandboxes, remove_sandbox, sweep_sandboxes


@pytest.fixture
def fake():
    fb = FakeBackend()
    registry.register("fake", fb)
    yield fb
    registry.unregister("fake")


@pytest.fixture
def store(tmp_path):
    s = LocalStore(tmp_path / "store")
    fake_lock(s)
    return s


def _create(store, node, **kw) -> Sandbox:
    return Sandbox.create("env/fake", store=store, node_dir=node, backend="fake", **kw)


def test_protocols_are_runtime_checkable(fake, store, tmp_path):
    assert isinstance(fake, Backend)
    for name in ("container", "microvm"):
        assert isinstance(registry.get_backend(name), Backend)
    with _create(store, tmp_path / "node") as sb:
        assert isinstance(sb.handle, SandboxHandle)
        assert isinstance(sb.handle, Snapshottable)


def test_create_exec_files_close(fake, store, tmp_path):
    node = tmp_path / "node"
    sb = _create(store, node)
    r = sb.exec("echo hi")
    assert (r.exit_code, r.stdout) == (0, b"echo hi\n")
    req = sb.handle.requests[-1]
    assert req.argv == ("/bin/sh", "-c", "echo hi")
    assert (req.cwd, req.user) == ("/workspace", "1000:1000")  # the lock's
    assert sb.exec(["cat"], stdin=b"in", user="0").stdout == b"cat\nin"
    sb.write_file("/a", "text")
    assert sb.read_file("/a") == b"text"
    assert fake.calls["create"] == 1 and fake.calls["exec"] == 2
    sb.close()
    sb.close()  # idempotent
    assert fake.calls["close"] == 1
    assert not any((node / "sandboxes").iterdir())
    with pytest.raises(SandboxClosed):
        sb.exec("true")
    with pytest.raises(SandboxClosed):
        sb.read_file("/a")


def test_store_as_a_path_string_and_node_dir_from_the_environment(fake, store, tmp_path,
                                                                  monkeypatch):
    node = tmp_path / "envnode"
    monkeypatch.setenv("ENVBUILD_NODE_CACHE", str(node))
    with Sandbox.create("env/fake", store=str(store.root), backend="fake") as sb:
        assert sb.paths.root.parent == node / "sandboxes"
        info = sb.info()
        assert info.node == str(node)
    assert (node / "layout.json").read_text() == f'{{"version": {LAYOUT_VERSION}}}'


def test_a_wrong_ref_raises_lock_not_found_and_makes_nothing(fake, store, tmp_path):
    node = tmp_path / "node"
    for ref in ("env/nope", "sha256:" + "0" * 64):
        with pytest.raises(LockNotFound) as e:
            Sandbox.create(ref, store=store, node_dir=node, backend="fake")
        assert isinstance(e.value, RefNotFound)
    assert not node.exists()
    assert fake.calls["create"] == 0


def test_unknown_backend_and_library_rules_fail_before_anything_is_made(store, tmp_path):
    node = tmp_path / "node"
    with pytest.raises(BackendUnavailable):
        Sandbox.create("env/fake", store=store, node_dir=node, backend="nope")
    with pytest.raises(BackendUnavailable):  # a microVM dies with its creator: no keep
        Sandbox.create("env/fake", store=store, node_dir=node, backend="microvm", keep=True)
    assert not node.exists()


def test_a_failed_start_leaves_no_sandbox_dir(store, tmp_path):
    fb = FakeBackend(fail_create=OSError("boom"))
    registry.register("fake", fb)
    try:
        with pytest.raises(OSError):
            _create(store, tmp_path / "node")
    finally:
        registry.unregister("fake")
    assert fb.calls["create"] == 1
    assert list((tmp_path / "node" / "sandboxes").iterdir()) == []


def test_exec_timeout_raises_only_when_asked(store, tmp_path):
    fb = FakeBackend(lambda req, stdin: FakeReply(chunks=[("stdout", b"part")],
                                                  timed_out=True))
    registry.register("fake", fb)
    try:
        with _create(store, tmp_path / "node") as sb:
            r = sb.exec("sleep 9", timeout=1)
            assert r.timed_out and r.exit_code == 124
            with pytest.raises(ExecTimeout) as e:
                sb.exec("sleep 9", timeout=1, check_timeout=True)
            assert e.value.result.stdout == b"part"
    finally:
        registry.unregister("fake")


def test_info_records_id_backend_lock_times_and_ttl(fake, store, tmp_path):
    before = time.time()
    with _create(store, tmp_path / "node", ttl=60) as sb:
        info = sb.info()
        assert (info.id, info.backend, info.lock) == (sb.id, "fake", sb.lock.digest)
        assert before <= info.created <= info.ready <= time.time()
        assert info.ttl == 60 and info.expires == pytest.approx(info.created + 60)
        assert info.pid == os.getpid() and info.alive
        assert [s.id for s in list_sandboxes(tmp_path / "node")] == [sb.id]


def test_ttl_reaper_thread_closes_a_forgotten_sandbox(fake, store, tmp_path):
    sb = _create(store, tmp_path / "node", ttl=0.3)
    deadline = time.monotonic() + 5
    while sb.paths.root.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sb.closed and fake.calls["close"] == 1
    assert not sb.paths.root.exists()
    with pytest.raises(SandboxClosed):
        sb.exec("true")


def test_expired_and_orphaned_sandboxes_are_reaped_at_the_next_create(fake, store, tmp_path):
    node = tmp_path / "node"
    old = _create(store, node, ttl=3600)
    kept = _create(store, node, keep=True)
    # what the records would say after an hour, and after the creator of `kept` died
    meta = old.paths.meta.read_text().replace('"expires": ', '"expires": 1, "x": ')
    old.paths.meta.write_text(meta)
    orphan = _create(store, node)
    orphan.paths.meta.write_text(orphan.paths.meta.read_text().replace(
        f'"pid": {os.getpid()}', '"pid": 999999999'))
    # ... and what the sweep index would say then (runtime_shim.node.owners): an expiry
    # passed, a creator gone. Without it the create trusts the index and sweeps nothing.
    layout = NodeLayout(node)
    (layout.owners / "next-expiry").write_text("1.0")
    (layout.owners / "999999999-1").touch()
    with _create(store, node) as new:
        ids = {s.id for s in list_sandboxes(node)}
        assert ids == {kept.id, new.id}  # expired and orphaned gone, kept stays
    assert fake.calls["remove"] == 2
    kept.close()


def test_gc_honours_ttl_even_for_kept_sandboxes(fake, store, tmp_path):
    node = tmp_path / "node"
    kept = _create(store, node, keep=True, ttl=3600)
    assert sweep_sandboxes(node) == []
    done = sweep_sandboxes(node, now=time.time() + 7200)
    assert [(r.id, r.reason, r.removed) for r in done] == [(kept.id, "expired", True)]
    assert list_sandboxes(node) == []


def test_attach_and_remove_by_id(fake, store, tmp_path):
    node = tmp_path / "node"
    sb = _create(store, node)
    other = Sandbox.attach(sb.id, node_dir=node)  # the store is the recorded one
    assert other.exec("echo x").stdout == b"echo x\n"
    assert fake.calls["attach"] == 1
    with pytest.raises(SandboxNotFound):
        Sandbox.attach("eb-000000000000", node_dir=node)
    with pytest.raises(SandboxNotFound):
        remove_sandbox(node, "eb-000000000000")
    remove_sandbox(node, sb.id)
    assert fake.calls["remove"] == 1 and list_sandboxes(node) == []


def test_node_layout_is_versioned(tmp_path):
    layout = NodeLayout(tmp_path / "n").ensure()
    assert layout.ensure() == layout
    layout.version_file.write_text('{"version": 99}')
    from envbuild.errors import RuntimeShimError

    with pytest.raises(RuntimeShimError):
        layout.ensure()
    with pytest.raises(RuntimeShimError):
        layout.sandbox("../x")


def test_store_and_node_default_to_the_clis(fake, store, tmp_path, monkeypatch):
    monkeypatch.setenv("ENVBUILD_STORE", str(store.root))
    monkeypatch.setenv("ENVBUILD_NODE_CACHE", str(tmp_path / "n"))
    with Sandbox.create("env/fake", backend="fake") as sb:
        assert sb.exec("echo ok").stdout == b"echo ok\n"
        assert Sandbox.attach(sb.id).id == sb.id  # the recorded store, the default node


def test_a_missing_store_dir_is_not_created(fake, tmp_path):
    from envbuild.errors import StoreUnavailable

    with pytest.raises(StoreUnavailable):
        Sandbox.create("env/fake", store=str(tmp_path / "nostore"), node_dir=tmp_path / "n",
                       backend="fake")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_concurrent_first_creates_on_a_fresh_node_agree_on_the_layout(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    node = tmp_path / "fresh"
    for _ in range(20):  # the race is in the first ensure() of a node
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: NodeLayout(node).ensure(), range(8)))
        assert (node / "layout.json").is_file()
        assert sorted(p.name for p in node.iterdir()) == ["layout.json", "sandboxes"]
        assert (node / "sandboxes").stat().st_mode & 0o777 == 0o700
        (node / "layout.json").unlink()


def test_a_dead_owners_sweep_takes_only_what_it_made_before_it_died(fake, store, tmp_path):
    """``runtime_shim.sdk.exitwatch``'s sweep: the owner's sandboxes made before its death, not
    its kept ones, not another process's, not one made after (by a process that reused the
    pid)."""
    node = tmp_path / "node"
    died = time.time()
    mine = _create(store, node)
    kept = _create(store, node, keep=True)
    other = _create(store, node)
    later = _create(store, node)
    other.paths.meta.write_text(other.paths.meta.read_text().replace(
        f'"pid": {os.getpid()}', '"pid": 999999999'))
    later.paths.meta.write_text(later.paths.meta.read_text().replace(
        '"created": ', f'"created": {died + 100}, "was": '))
    done = sweep_sandboxes(node, dead_owner=os.getpid(), now=died + 10)
    assert [(r.id, r.reason, r.removed) for r in done] == [(mine.id, "orphaned", True)]
    assert {s.id for s in list_sandboxes(node)} == {kept.id, other.id, later.id}
    for sb in (kept, other, later):
        sb.close()


def test_exit_hook_closes_what_this_process_did_not_close_but_kept_ones(fake, store, tmp_path,
                                                                        monkeypatch):
    from runtime_shim.isolation import lifecycle

    monkeypatch.setattr(lifecycle, "_exiting", False)  # the hook sets it; undone afterwards
    node = tmp_path / "node"
    left = _create(store, node)
    kept = _create(store, node, keep=True)
    closed = _create(store, node)
    closed.close()
    lifecycle.close_at_exit()
    assert left.closed and not kept.closed
    assert lifecycle.exiting()
    assert {s.id for s in list_sandboxes(node)} == {kept.id}
    kept.close()


def test_create_takes_one_options_value_or_its_fields(tmp_path):
    """``Sandbox.create(lock, SandboxOptions(...))`` and keyword fields are the same request;
    an unknown option is one clear error before anything is made."""
    from runtime_shim import SandboxOptions

    opts = SandboxOptions(ttl=30)
    assert SandboxOptions.of(opts, {"keep": True}) == SandboxOptions(ttl=30, keep=True)
    assert SandboxOptions.of(None, {}) == SandboxOptions()
    with pytest.raises(RuntimeShimError, match="unknown sandbox option") as e:
        SandboxOptions.of(None, {"tll": 30})
    assert "ttl" in (e.value.hint or "")


def test_public_introspection_of_a_sandbox(fake, store, tmp_path):
    """``limits``, ``host_pid`` and ``handle`` are public: tests and tools need not read
    ``_backend``. A handle with no host process (the fake) has no host pid."""
    from runtime_shim import Limits, Sandbox

    with Sandbox.create(fake_lock(store), store=store, node_dir=tmp_path / "node",
                        backend="fake", limits=Limits(pids=64)) as sb:
        assert sb.limits.pids == 64
        assert sb.handle is sb._backend
        assert sb.host_pid is None
