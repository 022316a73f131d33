"""Sandbox fleets on the session's real 2-node Ray cluster (``ray_cluster``), real runc
sandboxes, a local directory store (single host) and a real S3 (moto): the issue's "done when"
(50 sandboxes from one call, the driver SIGKILLed, a new driver attaches to every one, an exec
log replayed), daemon crash re-adoption, leases, warm pools, lost nodes and bad input. Every
test checks nothing is left: sandboxes, mounts, daemon actors."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from envbuild.errors import LockNotFound, NodeLost, SandboxNotFound
from runtime_shim.node.model import Limits
from tests.conftest import REPO
from tests.store.s3server import moto_s3  # noqa: F401  (session fixture)

pytestmark = pytest.mark.integration

LOCK = "env/busybox-shell"
#: no scratch disk per sandbox (a loop device each): 50 at once stay cheap on this host
# small: 50 sandboxes on this host's two nodes fit the node budget (runtime_shim.node.admission: a
# default sandbox reserves 256 x 1024 of fs.file-max)
LIMITS = Limits(disk_bytes=None, memory_bytes=64 << 20, pids=32, nofile=256)


def _mounts_under(root: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(root))]


def _sandbox_mounts_under(root: Path) -> list[str]:
    """The mounts under ``root`` but an empty disk pool: a node keeps its pool mounted for a
    grace after its last sandbox closed (``runtime_shim.node.diskpool``), unmounted at the
    daemons' stop (the module's teardown checks that)."""
    from runtime_shim.isolation.quotafs import is_empty

    return [m for m in _mounts_under(root)
            if not (m.endswith("/diskpool/mnt") and is_empty(Path(m)))]


def _sandbox_dirs(nodes_root: Path) -> list[str]:
    return sorted(str(p) for p in nodes_root.glob("*/sandboxes/*"))


def _daemon_actors() -> list[str]:
    """Names of the fleet daemon actors alive (or restarting) on the cluster."""
    import ray

    assert ray.is_initialized()
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("envbuild-node-"))


@pytest.fixture(scope="module")
def env(ray_cluster, tmp_path_factory):
    from tests.integration.conftest import build_busybox_env

    root = tmp_path_factory.mktemp("fleet")
    store, _ = build_busybox_env(root / "built")
    return {"cluster": ray_cluster, "store": str(store.root), "nodes": root / "nodes",
            "template": str(root / "nodes" / "{node_id}")}


@pytest.fixture(scope="module")
def fleet(env):
    import ray

    from runtime_shim.fleet import Fleet

    ray.init(address=env["cluster"].address, namespace="envbuild", log_to_driver=False,
             ignore_reinit_error=True)
    f = Fleet.connect(address=env["cluster"].address, store=env["store"],
                      node_dir=env["template"], slots=80)
    try:
        yield f
    finally:
        f.stop_daemons()
        try:
            assert _daemon_actors() == []
            assert _sandbox_dirs(env["nodes"]) == []
            assert _mounts_under(env["nodes"]) == []
        finally:
            ray.shutdown()


@pytest.fixture
def clean(fleet, env):
    """After the test: nothing of the fleet's is left but the (idle) daemons."""
    yield fleet
    fleet.close_all()
    deadline = time.monotonic() + 10
    while _sandbox_dirs(env["nodes"]) and time.monotonic() < deadline:
        time.sleep(0.1)  # a pool being emptied
    assert fleet.list() == []
    assert _sandbox_dirs(env["nodes"]) == []
    assert _sandbox_mounts_under(env["nodes"]) == [], "a sandbox's mounts were left behind"


DRIVER = textwrap.dedent("""
    import json, sys, time
    from runtime_shim.fleet import Fleet
    from runtime_shim.node.model import Limits
    address, store, out = sys.argv[1:4]
    fleet = Fleet.connect(address=address, store=store, start=False)
    sbs = fleet.create("env/busybox-shell", n=50, exec_log=True, ttl=600,
                       limits=Limits(disk_bytes=None, memory_bytes=64 << 20, pids=32,
                                     nofile=256))
    for sb in sbs:
        sb.write_file("/tmp/who", sb.id)
        r = sb.exec("echo state-of-$(cat /tmp/who) > /tmp/state; mkdir -p /work/a/b")
        assert r.ok, r
    json.dump([sb.id for sb in sbs], open(out + ".tmp", "w"))
    import os; os.rename(out + ".tmp", out)
    time.sleep(3600)  # mid-episode: the test SIGKILLs this driver
""")


def test_done_when_50_sandboxes_outlive_a_killed_driver_and_replay(clean, env, tmp_path):
    fleet = clean
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    out = tmp_path / "ids.json"
    proc = subprocess.Popen([sys.executable, str(script), env["cluster"].address, env["store"],
                             str(out)], env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not out.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the driver did not create its sandboxes"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
    ids = json.loads(out.read_text())
    assert len(set(ids)) == 50
    assert len({i.split("@")[1] for i in ids}) == 2, "one call spreads over both nodes"

    time.sleep(1)  # the driver is gone; its sandboxes must not be
    listed = {r.id for r in fleet.list()}
    assert listed == set(ids)
    for fid in ids:
        sb = fleet.attach(fid)
        assert sb.read_file("/tmp/who") == fid.encode()
        assert sb.read_file("/tmp/state") == f"state-of-{fid}\n".encode()
        assert sb.exec("test -d /work/a/b").ok

    # the exec log of one of them, replayed into a fresh sandbox, re-creates its state
    source = fleet.attach(ids[7])
    assert source.exec_log
    fresh = fleet.create(LOCK, n=1, limits=LIMITS)[0]
    assert not fresh.exec("test -e /tmp/state").ok
    report = fleet.replay(source.exec_log, into=fresh)
    # the write, the driver's exec and the attach check above, in that order
    assert report.ran == 3 and report.differed == ()
    assert fresh.read_file("/tmp/state") == f"state-of-{ids[7]}\n".encode()
    assert fresh.exec("test -d /work/a/b").ok

    closed = fleet.close_all()
    assert set(ids) | {fresh.id} == set(closed)
    with pytest.raises(SandboxNotFound):
        fleet.attach(ids[0])


def test_exec_streams_and_async_and_pack_diff(clean):
    import asyncio

    fleet = clean
    sb = fleet.create(LOCK, n=1, limits=LIMITS)[0]
    chunks: list[bytes] = []
    r = sb.exec("echo one; sleep 0.3; echo two; echo err >&2", on_stdout=chunks.append)
    assert r.ok and r.stdout == b"one\ntwo\n" and r.stderr == b"err\n"
    assert chunks[0] == b"one\n" and b"".join(chunks) == b"one\ntwo\n"
    assert sb.info().id == sb.sdk_id

    async def rollout() -> list[bytes]:
        a = sb.aio()
        await a.write_file("/a.txt", b"async")
        results = await asyncio.gather(*(a.exec(f"echo {i}") for i in range(8)))
        return [await a.read_file("/a.txt")] + [x.stdout for x in results]

    got = asyncio.run(rollout())
    assert got[0] == b"async" and got[1:] == [f"{i}\n".encode() for i in range(8)]
    snap = sb.pack_diff()
    assert snap.lock.startswith("sha256:")
    child = fleet.create(snap.lock, n=1, limits=LIMITS)[0]
    assert child.read_file("/a.txt") == b"async"


def test_a_crashed_daemon_re_adopts_its_sandboxes_and_reaps_half_made_ones(clean, env):
    import ray

    from runtime_shim.fleet.daemon import actor_name
    from runtime_shim.node.layout import NodeLayout
    from runtime_shim.sdk.sandbox import Sandbox

    fleet = clean
    sbs = fleet.create(LOCK, n=4, limits=LIMITS)
    sbs[0].write_file("/tmp/keep", b"kept")
    node = sbs[0].node_id
    # a sandbox made in the node dir but never recorded by the daemon (a create cut short)
    layout = NodeLayout(env["template"].replace("{node_id}", node))
    stray = Sandbox.create(LOCK, store=env["store"], node_dir=layout, limits=LIMITS,
                           keep=True, reap=False)
    old = fleet.call(node, "hello")
    ray.kill(ray.get_actor(actor_name(node), namespace="envbuild"), no_restart=False)
    deadline = time.monotonic() + 60
    while True:  # Ray restarts the actor on the same node; it reads its node dir back
        try:
            hello = fleet.call(node, "hello", timeout=5)
            if hello["pid"] != old["pid"]:
                break
        except NodeLost:
            pass
        assert time.monotonic() < deadline, "the daemon was not restarted"
        time.sleep(0.5)
    mine = {s.sdk_id for s in sbs if s.node_id == node}
    assert set(hello["adopted"]) == mine
    assert stray.id in hello["reaped"]
    assert not stray.paths.root.exists()
    assert fleet.attach(sbs[0].id).read_file("/tmp/keep") == b"kept"


def test_a_lease_nobody_renews_is_reaped(clean):
    fleet = clean
    short, renewed = fleet.create(LOCK, n=2, limits=LIMITS, ttl=3)
    for _ in range(5):
        time.sleep(1)
        renewed.renew()
    with pytest.raises(SandboxNotFound):
        fleet.attach(short.id)
    assert fleet.attach(renewed.id).exec("true").ok


def test_warm_pool_create_is_a_claim_and_refills(clean, env):
    fleet = clean
    key = fleet.warm(LOCK, per_node=2, limits=LIMITS, wait=120)
    pools = {s.node_id: dict(s.pools)[key] for s in fleet.nodes(pool_keys=[key])}
    assert list(pools.values()) == [2, 2]
    warm_ids = {d for d in _sandbox_dirs(env["nodes"])}
    t0 = time.monotonic()
    got = fleet.create(LOCK, n=4, limits=LIMITS)
    claim = time.monotonic() - t0
    assert {f"{Path(d).parent.parent.name[:12]}" for d in warm_ids} == {
        s.node_id[:12] for s in got}
    assert {Path(d).name for d in warm_ids} == {s.sdk_id for s in got}, "claimed, not started"
    assert all(s.exec("true").ok for s in got)
    deadline = time.monotonic() + 120
    while any(dict(s.pools)[key] < 2 for s in fleet.nodes(pool_keys=[key])):
        assert time.monotonic() < deadline, "the pools did not refill"
        time.sleep(0.2)
    fleet.warm(LOCK, per_node=0, limits=LIMITS)
    print(f"claim of 4 warm sandboxes: {claim * 1000:.1f} ms")


def test_first_exec_rides_in_the_claim_and_the_create_batch(clean, env):
    """``create(first_exec=...)``: claimed (warm) and started sandboxes alike run the command
    inside the create call, hand back its result, keep its effect and log it."""
    from runtime_shim.fleet import execlog

    fleet = clean
    key = fleet.warm(LOCK, per_node=1, limits=LIMITS, wait=120)
    warm_ids = {Path(d).name for d in _sandbox_dirs(env["nodes"])}
    cmd = "echo $((40+2)) > /tmp/first; cat /tmp/first"
    got = fleet.create(LOCK, n=3, limits=LIMITS, first_exec=cmd)
    fleet.warm(LOCK, per_node=0, limits=LIMITS)
    assert len(got) == 3 and len(warm_ids) == 2
    assert len(warm_ids & {s.sdk_id for s in got}) == 2, "two claimed, one started"
    for sb in got:
        assert sb.first_result is not None and sb.first_result.ok
        assert sb.first_result.stdout == b"42\n"
        assert sb.read_file("/tmp/first") == b"42\n"
    plain = fleet.create(LOCK, n=1, limits=LIMITS)[0]
    assert plain.first_result is None
    logged = fleet.create(LOCK, n=1, limits=LIMITS, exec_log=True, first_exec=["true"])[0]
    entries = execlog.read(fleet.store, logged.exec_log).entries
    assert [(e.op, e.cmd) for e in entries] == [("exec", ("true",))]
    assert key


def test_a_first_exec_that_fails_leaves_no_sandbox_claimed_or_started(clean, env):
    from envbuild.errors import RuntimeShimError

    fleet = clean
    fleet.warm(LOCK, per_node=1, limits=LIMITS, wait=120)
    with pytest.raises(RuntimeShimError, match="exec needs a command"):
        fleet.create(LOCK, n=2, limits=LIMITS, first_exec=[])  # the warm claim path
    fleet.warm(LOCK, per_node=0, limits=LIMITS)
    with pytest.raises(RuntimeShimError, match="exec needs a command"):
        fleet.create(LOCK, n=3, limits=LIMITS, first_exec=[])  # the create batch path
    assert fleet.list() == []
    deadline = time.monotonic() + 60  # a refill in flight when the pool stopped is closed
    while sum(s.used for s in fleet.nodes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(s.used for s in fleet.nodes()) == 0


def test_daemon_and_its_sandboxes_run_at_normal_priority(clean):
    """Ray starts workers at nice 15; the daemon resets every thread it has to 0, so its
    starts and the sandboxes' processes are not starved behind every other process."""
    fleet = clean
    for nid in fleet.node_ids:
        pid = fleet.call(nid, "hello")["pid"]
        nice = {int(Path(t, "stat").read_text().rsplit(")", 1)[1].split()[16])
                for t in Path(f"/proc/{pid}/task").iterdir()}
        assert nice == {0}, f"daemon {pid} threads at nice {nice}"
    sb = fleet.create(LOCK, n=1, limits=LIMITS)[0]
    r = sb.exec("cat /proc/self/stat")
    assert r.ok and r.stdout.rsplit(b")", 1)[1].split()[16] == b"0", r.stdout


def test_bad_input_is_one_error_and_leaves_nothing(clean, env):
    fleet = clean
    with pytest.raises(LockNotFound, match="fleet's store"):
        fleet.create("env/no-such-env", n=3)
    with pytest.raises(SandboxNotFound, match="not of this cluster"):
        fleet.attach("eb-0123456789ab@ffffffffffff")
    with pytest.raises(SandboxNotFound, match="not a fleet sandbox id"):
        fleet.attach("eb-../../etc")
    with pytest.raises(Exception, match="room for") as e:
        fleet.create(LOCK, n=1000, limits=LIMITS)
    assert getattr(e.value, "reference", "") == "fleet-full"
    assert _sandbox_dirs(env["nodes"]) == []


def test_an_unreachable_cluster_fails_fast(tmp_path):
    code = ("from runtime_shim.fleet import Fleet\n"
            f"Fleet.connect(address='127.0.0.1:1', store={str(tmp_path)!r})\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert time.monotonic() - t0 < 30
    assert proc.returncode != 0
    assert "FleetUnavailable" in proc.stderr and "cannot reach the Ray cluster" in proc.stderr


def test_a_lost_node_gives_node_lost_never_a_hang(clean, env):
    import ray

    from runtime_shim.fleet import CreateSpec
    from runtime_shim.fleet.client import FleetSandbox, start_daemons
    from runtime_shim.fleet.daemon import DaemonConfig, reap_node_dir
    from runtime_shim.node.locks import resolve

    fleet = clean
    cluster = env["cluster"]
    extra = cluster.add_node()
    node_id = cluster.node_id(extra)
    try:
        config = DaemonConfig(store=env["store"], node_dir=env["template"], slots=8)
        fleet._daemons.update(start_daemons(config, node_ids=[node_id]))
        spec = CreateSpec(lock=resolve(fleet.store, LOCK).digest, limits=LIMITS)
        records = fleet.call(node_id, "create_batch", spec, 2)
        sbs = [FleetSandbox(fleet, r) for r in records]
        assert sbs[0].exec("echo up").stdout == b"up\n"
        daemon_pid = fleet.call(node_id, "hello")["pid"]
    finally:
        cluster.kill_node(extra)
    # a lost machine takes its processes with it; on this host the daemon's worker outlives
    # its raylet for a while, so it goes the same way
    with contextlib.suppress(ProcessLookupError):
        os.kill(daemon_pid, signal.SIGKILL)
    try:
        t0 = time.monotonic()
        with pytest.raises(NodeLost, match="lost"):
            sbs[0].exec("true")
        assert time.monotonic() - t0 < 60
        deadline = time.monotonic() + 90
        while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            assert time.monotonic() < deadline, "Ray never noticed the node is gone"
            time.sleep(0.5)
        t0 = time.monotonic()
        with pytest.raises(NodeLost):
            fleet.attach(sbs[1].id)
        assert time.monotonic() - t0 < 70
        assert node_id not in fleet.node_ids  # the dead node's daemon actor is dropped
    finally:
        # the machine is gone; on this one host its sandboxes are still here: a reboot of it
        # reaps them
        removed = reap_node_dir(env["template"].replace("{node_id}", node_id))
    assert set(removed) == {s.sdk_id for s in sbs}
    assert not [a for a in _daemon_actors() if node_id in a]
    assert ray.is_initialized()


def test_job_manifest_across_the_fleet_and_s3_store(fleet, env, moto_s3, tmp_path):
    """A real S3 (moto) as the fleet's store: the daemons read layers from the bucket."""
    from envbuild.store import LocalStore, open_store
    from envbuild.store.sync import sync
    from runtime_shim.fleet import Fleet
    from tests.store.s3server import CREDENTIALS

    bucket = moto_s3.make_bucket()
    url = f"s3://{bucket}/fleet"
    for k, v in CREDENTIALS.items():
        os.environ.setdefault(k, v)
    s3 = open_store(url, s3_endpoint=moto_s3.endpoint)
    sync(LocalStore(env["store"]), s3, refs=[LOCK])
    fleet.stop_daemons()
    try:
        s3_fleet = Fleet.connect(address=env["cluster"].address, store=url,
                                 s3_endpoint=moto_s3.endpoint,
                                 node_dir=str(env["nodes"] / "s3-{node_id}"), slots=16,
                                 runtime_env={"env_vars": dict(CREDENTIALS)})
        sbs = s3_fleet.create(LOCK, n=4, limits=LIMITS)
        assert {s.node_id for s in sbs} == set(s3_fleet.node_ids)
        assert all(s.exec("test -x /bin/sh").ok for s in sbs)
        assert sum(n.pulled_bytes for n in s3_fleet.nodes()) > 0
        assert len(s3_fleet.close_all()) == 4
        s3_fleet.stop_daemons()
        assert _daemon_actors() == []
    finally:  # the module's local-store daemons again, for the tests after this one
        new = Fleet.connect(address=env["cluster"].address, store=env["store"],
                            node_dir=env["template"], slots=80)
        fleet._daemons = new._daemons
    assert _sandbox_dirs(env["nodes"]) == []


JOB = """\
apiVersion: envbuild/v1
kind: JobManifest
name: fleet-smoke
groups:
  - name: shell
    lock: busybox-shell
    count: 3
    limits: {pids: 64, memory: 64MiB}
  - name: more
    lock: busybox-shell
    count: 2
    limits: {pids: 32, memory: 64MiB}
"""


def test_job_run_of_a_task_group_prints_its_task_lock(clean, env, tmp_path, capsys):
    """Issue 35: a group naming a task runs its env lock; ``job run --json`` names the task
    lock each group is graded by (null for a plain lock)."""
    from envbuild.build.taskbuild import hidden_layer, task_spec
    from envbuild.cli.main import main
    from envbuild.defs.model import Origin, PathSource, Task
    from envbuild.store import KeyRecord, LocalStore, digest_bytes, put_bytes
    from runtime_shim.node import publish_task

    store = LocalStore(env["store"])
    lock = store.get_ref("env/busybox-shell").digest
    hidden = put_bytes(store, b"a hidden layer the fleet never reads")
    record = KeyRecord(layer=hidden, toc=digest_bytes(b"t"), diff_id=digest_bytes(b"d"),
                       size=store.stat(hidden).size)
    task = Task(name="kv-task", origin=Origin(file="t.yaml", line=1, column=1),
                env="busybox-shell", workdir="/workspace", hidden=PathSource("hidden"))
    digest = publish_task(store, task_spec(task, lock), hidden_layer(record), ref="task/kv-task")
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("lock: busybox-shell\n    count: 3", "task: kv-task\n    count: 2"))

    def cli(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["--store", env["store"], *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    assert cli("job", "resolve", str(job))[0] == 0
    code, out, err = cli("job", "run", str(tmp_path / "job.resolved.yaml"), "--fleet",
                         env["cluster"].address, "--json")
    assert code == 0, err
    groups = json.loads(out)["groups"]
    assert [(g["group"], g["lock"], g["task"], len(g["sandboxes"])) for g in groups] == [
        ("shell", lock, digest, 2), ("more", lock, None, 2)]
    assert {s.lock for s in clean.list()} == {lock}  # the env lock: no hidden layer


def test_cli_job_run_and_fleet_commands(clean, env, tmp_path, capsys):
    from envbuild.cli.main import main

    address = env["cluster"].address

    def cli(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["--store", env["store"], *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    code, _, err = cli("job", "run", str(job), "--fleet", address)
    assert code == 1 and "not resolved" in err and "Traceback" not in err
    assert cli("job", "resolve", str(job))[0] == 0
    code, out, err = cli("job", "run", str(tmp_path / "job.resolved.yaml"), "--fleet", address,
                         "--json")
    assert code == 0, err
    groups = json.loads(out)["groups"]
    assert [(g["group"], len(g["sandboxes"])) for g in groups] == [("shell", 3), ("more", 2)]
    ids = {i for g in groups for i in g["sandboxes"]}

    code, out, _ = cli("fleet", "ls", "--address", address, "--json")
    assert code == 0 and {r["id"] for r in json.loads(out)} == ids
    code, out, _ = cli("fleet", "nodes", "--address", address, "--json")
    assert code == 0 and sum(n["used"] for n in json.loads(out)) == 5
    first = sorted(ids)[0]
    code, out, _ = cli("fleet", "rm", first, "--address", address)
    assert code == 0 and out.strip() == f"removed {first}"
    code, out, _ = cli("fleet", "rm", "eb-0123456789ab@ffffffffffff", "--address", address)
    assert code == 1 and "not of this cluster" in out
    second = sorted(ids)[1]
    code, out, _ = cli("fleet", "rm", second, "eb-0123456789ab@ffffffffffff", "--address",
                       address, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["removed"] == [second]
    assert [f["id"] for f in doc["failed"]] == ["eb-0123456789ab@ffffffffffff"]
    assert "not of this cluster" in doc["failed"][0]["error"]
    assert cli("fleet", "gc", "--address", address)[0] == 0
    code, out, _ = cli("fleet", "gc", "--address", address, "--json")
    assert (code, json.loads(out)) == (0, {"removed": []})
    code, out, _ = cli("fleet", "rm", "--all", "--address", address, "--json")
    assert code == 0 and len(json.loads(out)["removed"]) == 3
    code, out, _ = cli("fleet", "ls", "--address", address)
    assert code == 0 and out == ""


def test_fast_forward_answers_the_matching_prefix_then_runs_from_that_state(clean):
    fleet = clean
    first = fleet.create(LOCK, n=1, limits=LIMITS, exec_log=True)[0]
    first.write_file("/note", b"v1")
    r1 = first.exec("cat /note; echo $$")  # the pid differs per run: a replay would differ
    first.exec("echo more >> /note")
    restarted = fleet.create(LOCK, n=1, limits=LIMITS)[0]
    ff = fleet.fast_forward(first.exec_log, into=restarted)
    ff.write_file("/note", b"v1")
    assert ff.exec("cat /note; echo $$") == r1  # the recorded result, not a new run
    assert ff.matched == 2 and not restarted.exec("test -e /note").ok  # nothing ran yet
    r = ff.exec("cat /note")  # diverges: the matched prefix is replayed first
    assert r.stdout == b"v1"
    assert restarted.read_file("/note") == b"v1"


def test_a_node_without_its_oci_runtime_fails_the_batch_in_one_line(env, tmp_path):
    """The daemon class itself (no Ray needed for this check): a missing runtime is the
    SDK's one-line error, and nothing of the batch is left."""
    from envbuild.errors import RuntimeShimError
    from runtime_shim.fleet.daemon import CreateSpec, DaemonConfig, NodeDaemon
    from runtime_shim.node.locks import resolve

    d = NodeDaemon(DaemonConfig(store=env["store"], node_dir=str(tmp_path / "{node_id}"),
                                runtime="runc-not-installed"), node_id="ef" * 28)
    try:
        spec = CreateSpec(lock=resolve(d.store, LOCK).digest, limits=LIMITS)
        with pytest.raises(RuntimeShimError) as e:
            d.create_batch(spec, 3)
        assert "runc-not-installed" in e.value.message and "\n" not in e.value.message
        assert d.status().used == 0
    finally:
        d.shutdown()
    assert not list((tmp_path / ("ef" * 28) / "sandboxes").glob("*"))
