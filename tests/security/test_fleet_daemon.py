"""Attacks on the fleet's node daemon (``runtime_shim.fleet.daemon``), run against the real
daemon class with real runc sandboxes (Ray only carries the calls; the checks are the
daemon's): ids that are paths, exec log names that are paths, a sandbox flooding its stream."""

from __future__ import annotations

import time

import pytest

from envbuild.errors import EnvbuildError, SandboxNotFound
from runtime_shim.fleet.daemon import CreateSpec, DaemonConfig, NodeDaemon
from runtime_shim.node.locks import resolve
from runtime_shim.node.model import Limits

pytestmark = pytest.mark.integration


@pytest.fixture
def daemon(busybox_store, tmp_path):
    store, _ = busybox_store
    d = NodeDaemon(DaemonConfig(store=str(store.root), node_dir=str(tmp_path / "n-{node_id}"),
                                slots=4), node_id="ab" * 28)
    try:
        yield d, store
    finally:
        d.shutdown()
        left = tmp_path / ("n-" + "ab" * 28) / "sandboxes"
        assert not left.exists() or not list(left.iterdir())


def test_a_sandbox_id_that_is_a_path_never_reaches_the_disk(daemon, tmp_path):
    d, _ = daemon
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "sandbox.json").write_text("{}")
    rel = "../../" + victim.name
    for call in (lambda: d.close(rel), lambda: d.exec(rel, "true", {}),
                 lambda: d.read_file(rel, "/etc/passwd"), lambda: d.renew(rel),
                 lambda: d.close("eb-0123456789ab/../../victim")):
        with pytest.raises(SandboxNotFound, match="not a sandbox id"):
            call()
    assert (victim / "sandbox.json").exists()


def test_exec_log_names_cannot_escape_the_store(daemon):
    d, store = daemon
    spec = CreateSpec(lock=resolve(store, "env/busybox-shell").digest,
                      limits=Limits(disk_bytes=None))
    (rec,) = d.create_batch(spec, 1)
    sid = rec.id.split("@")[0]
    with pytest.raises(EnvbuildError):
        d.replay("../../refs", sid)
    with pytest.raises(EnvbuildError):
        d.replay("eb-x/../../../etc", sid)


def test_a_stream_flood_is_bounded_by_the_output_cap(daemon):
    d, store = daemon
    spec = CreateSpec(lock=resolve(store, "env/busybox-shell").digest,
                      limits=Limits(disk_bytes=None, output_bytes=1 << 20))
    (rec,) = d.create_batch(spec, 1)
    sid = rec.id.split("@")[0]
    total = 0
    result = None
    for kind, value in d.exec_stream(sid, "yes flood | head -c 50000000", {"timeout": 60}):
        if kind in ("stdout", "stderr"):
            total += len(value)
        elif kind == "result":
            result = value
    assert result is not None and result.output_truncated
    assert total <= 2 << 20 and len(result.stdout) <= 1 << 20


def test_shutdown_while_a_pool_fills_leaves_no_sandbox(daemon):
    d, store = daemon
    spec = CreateSpec(lock=resolve(store, "env/busybox-shell").digest,
                      limits=Limits(disk_bytes=None))
    d.warm(spec, 3)
    deadline = time.monotonic() + 60
    while not any(d.layout.sandboxes.glob("eb-*")):  # a pool start is under way
        assert time.monotonic() < deadline
        time.sleep(0.005)
    d.shutdown()  # the fixture checks the node dir has no sandbox left
