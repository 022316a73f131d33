"""A fleet whose node daemons start sandboxes through create worker processes
(``DaemonConfig.workers``, ``runtime_shim.fleet.workers``) and serve exec and files on a data
plane (``DaemonConfig.data_host``, ``runtime_shim.fleet.dataplane``), on the session's real
2-node Ray cluster with real runc sandboxes: each sandbox is made by a worker (its record names
a worker's pid, a child of the daemon), then belongs to the daemon like any other (exec, files,
close, ``gc`` leaves it alone); its exec and files go over the data plane, not Ray, and are in
its exec log; nothing is left at the end."""

from __future__ import annotations

import pytest

from runtime_shim.fleet.workers import child_of
from tests.integration.test_fleet import LIMITS, LOCK, _daemon_actors, _mounts_under, _sandbox_dirs

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker_fleet(ray_cluster, tmp_path_factory):
    import ray

    from runtime_shim.fleet import Fleet
    from tests.integration.conftest import build_busybox_env

    root = tmp_path_factory.mktemp("fleet-workers")
    store, _ = build_busybox_env(root / "built")
    ray.init(address=ray_cluster.address, namespace="envbuild", log_to_driver=False,
             ignore_reinit_error=True)
    f = Fleet.connect(address=ray_cluster.address, store=str(store.root),
                      node_dir=str(root / "nodes" / "{node_id}"), slots=40, max_starting=2,
                      workers=2, data_host="127.0.0.1")
    try:
        yield f, root / "nodes"
    finally:
        f.stop_daemons()
        try:
            assert _daemon_actors() == []
            assert _sandbox_dirs(root / "nodes") == []
            assert _mounts_under(root / "nodes") == []
        finally:
            ray.shutdown()


def test_workers_make_the_sandboxes_and_the_daemon_owns_them(worker_fleet):
    fleet, nodes = worker_fleet
    hello = {nid: fleet.call(nid, "hello") for nid in fleet.node_ids}
    for h in hello.values():
        assert len(h["workers"]) == 2 and all(child_of(p, h["pid"]) for p in h["workers"])
    sbs = fleet.create(LOCK, n=6, limits=LIMITS, first_exec="echo hi > /tmp/x; cat /tmp/x")
    assert [sb.first_result.stdout for sb in sbs] == [b"hi\n"] * 6
    for sb in sbs:
        info = sb.info()
        assert info.pid in hello[sb.node_id]["workers"], "made in a worker, not the daemon"
        sb.write_file("/tmp/y", b"data")
        assert sb.exec("cat /tmp/y").stdout == b"data"
    assert fleet.gc() == [], "gc leaves the workers' sandboxes alone"
    assert len(fleet.list()) == 6
    sbs[0].close()
    assert len(fleet.list()) == 5
    fleet.close_all()
    assert fleet.list() == [] and _sandbox_dirs(nodes) == []


def test_exec_and_files_go_over_the_data_plane_and_are_logged(worker_fleet, monkeypatch):
    from runtime_shim.fleet import execlog

    fleet, _ = worker_fleet
    (sb,) = fleet.create(LOCK, n=1, limits=LIMITS, exec_log=True)
    assert sb.record.token and sb.record.data_addr[0] == "127.0.0.1"

    def no_ray(*args, **kwargs):
        raise AssertionError("a control call for exec or files")

    monkeypatch.setattr(fleet, "call", no_ray)
    sb.write_file("/tmp/in", b"payload")
    r = sb.exec("cat /tmp/in; echo err >&2; exit 3", stdin=b"")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"payload", b"err\n")
    assert sb.exec(["sh", "-c", "cat"], stdin=b"x" * 100_000).stdout == b"x" * 100_000
    assert sb.read_file("/tmp/in") == b"payload"
    monkeypatch.undo()
    log = execlog.read(fleet.store, sb.exec_log)
    assert [e.op for e in log.entries] == ["write", "exec", "exec"]
    sb.close()
