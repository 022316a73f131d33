"""``envbuild build --executor ray`` on the session's real Ray cluster (head + 2 builder nodes),
into a real moto S3 over HTTP, with runc: issue 15's "done when".

Every CLI call is a fresh process (a driver joins the cluster with ``ray.init``), as in CI.
Each builder node has its own node cache (``{node_id}`` in ``ENVBUILD_NODE_CACHE``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from envbuild.store import KEY_RECORDS, get_key_record
from envbuild.store.lease import LEASES
from tests.conftest import REPO, require_root, require_tool
from tests.integration.conftest import copy_busybox_defs
from tests.leftovers import assert_nothing_left_under
from tests.store.s3server import CREDENTIALS, moto_s3  # noqa: F401  (session fixture)

pytestmark = pytest.mark.integration

FORWARD = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
           "AWS_EC2_METADATA_DISABLED", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


def synthetic_tree(defs: Path, count: int, *, sleep: float = 0.0, prefix: str = "ws") -> list[str]:
    """``count`` workspaces on busybox-tiny (each its own source, so its own key), each with a
    run step that writes a file and sleeps; one env per 10 of them."""
    root = defs.parent
    names = []
    for i in range(count):
        name = f"{prefix}{i:03d}"
        src = root / "sources" / name
        src.mkdir(parents=True, exist_ok=True)
        (src / "id.txt").write_text(f"{name}\n")
        (defs / "workspaces").mkdir(parents=True, exist_ok=True)
        (defs / "workspaces" / f"{name}.yaml").write_text(
            "apiVersion: envbuild/v1\nkind: Workspace\n"
            f"name: {name}\nbuild_on: busybox-tiny\n"
            f"source: {{path: ../../sources/{name}}}\ndest: /workspace\n"
            "steps:\n"
            f"  - run: cat /workspace/id.txt > /workspace/built && sleep {sleep}\n"
            "    network: none\n")
        names.append(name)
    (defs / "envs").mkdir(parents=True, exist_ok=True)
    for j in range(0, count, 10):
        (defs / "envs" / f"{prefix}-env{j:03d}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Env\nname: {prefix}-env{j:03d}\n"
            f"base: busybox-tiny\nworkspace: {names[j]}\ntoolkits: [shtest]\n")
    return names


class Cluster:
    """What a test needs to run drivers against the session cluster and one S3 prefix."""

    def __init__(self, ray_cluster, moto, tmp: Path) -> None:
        self.ray = ray_cluster
        self.moto = moto
        self.tmp = tmp
        self.bucket = moto.make_bucket()
        self.url = f"s3://{self.bucket}/farm"
        self.defs = tmp / "envdefs"
        copy_busybox_defs(self.defs)
        self.node_template = str(tmp / "node-{node_id}")

    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, **CREDENTIALS, "PYTHONPATH": str(REPO),
               "ENVBUILD_STORE": self.url, "ENVBUILD_S3_ENDPOINT": self.moto.endpoint,
               "ENVBUILD_DEFS": str(self.defs), "ENVBUILD_NODE_CACHE": self.node_template,
               "RAY_ADDRESS": self.ray.address, "ENVBUILD_LEASE_TTL": "10"}
        env.pop("AWS_ENDPOINT_URL", None)
        env.update(extra)
        return env

    def argv(self, *args: str) -> list[str]:
        fwd = [a for n in FORWARD for a in ("--ray-env", n)]
        return [sys.executable, "-m", "envbuild.cli", "build", "--executor", "ray",
                "--ray-address", self.ray.address, *fwd, *args]

    def build(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), env=self.env(), capture_output=True, text=True,
                              timeout=timeout)

    def store(self):
        from envbuild.store.s3 import S3Store

        return S3Store.from_url(self.url, endpoint_url=self.moto.endpoint)

    def node_dirs(self) -> list[Path]:
        return sorted(self.tmp.glob("node-*"))

    def worker_ids(self) -> set[str]:
        return {self.ray.node_id(n)[:8] for n in self.ray.workers}


def assert_no_leftovers(cluster: Cluster) -> None:
    """No lease in the store; no scratch dir or build container on any node cache; nothing
    under the test's dir left on the host (mounts, loop devices, processes)."""
    store = cluster.store()
    assert store.list_records(LEASES) == []
    for node in cluster.node_dirs():
        builds = node / "builds"
        left = [p.name for p in builds.iterdir()] if builds.exists() else []
        assert left == [], (node, left)
        state = node / "runc"
        assert not state.exists() or not any(state.iterdir()), list(state.iterdir())
    assert_nothing_left_under(cluster.tmp)


@pytest.fixture
def cluster(ray_cluster, moto_s3, tmp_path, monkeypatch):  # noqa: F811
    for k, v in CREDENTIALS.items():  # for this process's own look at the bucket
        monkeypatch.setenv(k, v)
    require_root()
    require_tool("runc")
    require_tool("busybox")
    return Cluster(ray_cluster, moto_s3, tmp_path)


def test_cluster_build_into_s3_then_a_second_machine_builds_nothing(cluster, tmp_path):
    names = synthetic_tree(cluster.defs, 50, sleep=0.2)
    r = cluster.build("--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    layers = {o["name"]: o for o in report["layers"]}
    assert set(names) | {"busybox-tiny", "kvsh", "shtest"} == set(layers)
    assert {o["status"] for o in layers.values()} == {"built"}
    nodes = {o["node"] for o in layers.values()}
    assert nodes <= cluster.worker_ids() and len(nodes) == 2, nodes  # spread, never the head
    assert all(o["seconds"] > 0 for o in layers.values())
    assert len(report["locks"]) == 6 and all(lk["digest"] for lk in report["locks"])
    store = cluster.store()
    for o in layers.values():
        rec = get_key_record(store, o["key"])
        assert rec is not None and rec.layer == o["digest"] and store.exists(rec.layer)
    assert len(cluster.node_dirs()) == 2  # one node cache per builder node
    assert_no_leftovers(cluster)

    # plain lines off a TTY name the node of each layer
    assert any(f" on {n}: done in" in r.stderr for n in nodes), r.stderr[-2000:]

    # a second machine: empty local store and node cache, --cache-from the farm's bucket
    env = {**cluster.env(), "ENVBUILD_STORE": str(tmp_path / "b-store"),
           "ENVBUILD_NODE_CACHE": str(tmp_path / "b-node")}
    b = subprocess.run([sys.executable, "-m", "envbuild.cli", "--cache-from", cluster.url,
                        "build", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stderr
    again = json.loads(b.stdout)
    assert {o["status"] for o in again["layers"]} == {"cached"}
    assert again["locks"] == report["locks"]
    assert not (tmp_path / "b-node" / "builds").exists() or \
        not any((tmp_path / "b-node" / "builds").iterdir())

    # and the cluster itself has nothing left to do
    r = cluster.build("--json")
    assert r.returncode == 0, r.stderr
    assert {o["status"] for o in json.loads(r.stdout)["layers"]} == {"cached"}


def test_a_build_of_one_layer_submits_its_layer_only_and_opens_one_node_cache(
        cluster, monkeypatch):
    """No task is submitted before the plan: a warm-up task per build slot was, at ray.init,
    so every builder node started all its worker processes and opened its node cache for any
    build, and the first layer waited for one of them. The library driver in this process
    (what the CLI runs), with the Ray tasks it submits recorded on their way."""
    import ray

    from envbuild.build.engine import load
    from envbuild.build.ray_executor import RayBuildRequest, build_ray, disconnect
    from envbuild.settings import Settings

    submitted: list[str] = []
    remote = ray.remote

    def recording(*args, **kwargs):
        if args and callable(args[0]):
            submitted.append(args[0].__name__)
        return remote(*args, **kwargs)

    monkeypatch.setattr(ray, "remote", recording)
    request = RayBuildRequest(address=cluster.ray.address, forward_env=FORWARD)
    try:
        report = build_ray(load(cluster.defs.absolute()), Settings.from_env(cluster.env()),
                           ["busybox-tiny"], request=request)
    finally:
        disconnect()
    assert submitted == ["run_layer"]
    [layer] = report.layers
    assert layer.status == "built" and layer.node in cluster.worker_ids()
    assert [p.name[len("node-"):][:8] for p in cluster.node_dirs()] == [layer.node]
    assert_no_leftovers(cluster)


def test_a_task_builds_on_the_cluster_and_its_task_lock_is_written(cluster):
    """Issue 35: a task's hidden layer is a Ray task like any layer; the driver locks the env,
    then the task (task/NAME in the bucket)."""
    from runtime_shim.node import load_task
    from tests.integration.test_task_lock import write_task

    write_task(cluster.defs)
    r = cluster.build("--json", "kv-task")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    hidden = next(o for o in report["layers"] if o["name"] == "kv-task:hidden")
    assert (hidden["kind"], hidden["status"]) == ("Task", "built")
    assert hidden["node"] in cluster.worker_ids()
    [task] = report["tasks"]
    lock = load_task(cluster.store(), "task/kv-task")
    assert (lock.digest, lock.hidden.digest) == (task["digest"], hidden["digest"])
    assert lock.spec.env_lock == report["locks"][0]["digest"] == task["env_lock"]
    assert_no_leftovers(cluster)


def test_the_example_envdefs_build_on_the_cluster_into_s3_and_a_second_machine_builds_nothing(
        cluster_examples, ray_cluster, monkeypatch):
    """The whole of envdefs/ (debootstrap base, Python base, workspaces, toolkits, envs),
    built once for the session on the cluster (the ``cluster_examples`` fixture, whose local
    store other tests reuse)."""
    from envbuild.defs import load_definitions
    from envbuild.store.s3 import S3Store

    for k, v in CREDENTIALS.items():  # for this process's own look at the bucket
        monkeypatch.setenv(k, v)
    ex = cluster_examples
    layers = {o["name"]: o for o in ex.report["layers"]}
    defs = load_definitions(str(ex.defs))
    expected = {n for n, d in defs.by_name.items() if d.kind != "Env"}
    assert expected >= {"debian-bookworm", "debian-bookworm-py311", "minicalc", "textstats",
                        "pytest", "ripgrep", "busybox-tiny"}
    assert set(layers) == expected
    assert {o["status"] for o in layers.values()} == {"built"}, layers
    workers = {ray_cluster.node_id(n)[:8] for n in ray_cluster.workers}
    nodes = {o["node"] for o in layers.values()}
    assert nodes <= workers and len(nodes) == 2, nodes
    envs = {n for n, d in defs.by_name.items() if d.kind == "Env"}
    assert {lk["env"] for lk in ex.report["locks"]} == envs
    assert all(lk["digest"] and not lk["error"] for lk in ex.report["locks"])
    store = S3Store.from_url(ex.url, endpoint_url=ex.endpoint)
    for o in layers.values():
        rec = get_key_record(store, o["key"])
        assert rec is not None and rec.layer == o["digest"] and store.exists(rec.layer)
    assert store.list_records(LEASES) == []
    # the second machine built nothing and has the same locks
    assert {o["status"] for o in ex.pulled["layers"]} == {"cached"}
    assert ex.pulled["locks"] == ex.report["locks"]
    for node in Path(ex.node_template).parent.glob("node-*"):
        assert not (node / "builds").exists() or not any((node / "builds").iterdir())
    assert_nothing_left_under(Path(ex.node_template).parent)


def test_step_failure_reports_on_the_driver_skips_only_dependents_and_stores_the_log(cluster):
    synthetic_tree(cluster.defs, 2)
    (cluster.defs / "base" / "broken.yaml").write_text(
        "apiVersion: envbuild/v1\nkind: Base\nname: broken\nabi: broken-abi\n"
        "from: {base: busybox-tiny}\n"
        "steps:\n  - run: echo first-line; echo the-cause-is-here >&2; exit 3\n"
        "    network: none\n")
    (cluster.defs / "workspaces" / "on-broken.yaml").write_text(
        "apiVersion: envbuild/v1\nkind: Workspace\nname: on-broken\nbuild_on: broken\n"
        "requires: {abi: [broken-abi]}\n"
        "source: {path: ../../sources/ws000}\ndest: /workspace\n")
    r = cluster.build("--json")
    assert r.returncode == 1
    report = {o["name"]: o for o in json.loads(r.stdout)["layers"]}
    assert report["broken"]["status"] == "failed"
    assert report["on-broken"]["status"] == "skipped"
    assert report["on-broken"]["blocked_by"] == "broken"
    assert report["ws000"]["status"] == report["ws001"]["status"] == "built"
    assert "exited 3" in r.stderr and "exit 3" in r.stderr  # exit code and command
    assert "the-cause-is-here" in r.stderr  # the log tail
    assert f"on node {report['broken']['node']}" in r.stderr
    store = cluster.store()
    log = store.get_record("logs/v1", report["broken"]["key"][7:])
    assert log is not None and log["exit_code"] == 3 and log["name"] == "broken"
    from envbuild.store import read_bytes

    text = read_bytes(store, log["log"]).decode()
    assert "first-line" in text and "the-cause-is-here" in text
    assert log["log"] in r.stderr  # the hint says where the full log is
    assert get_key_record(store, report["broken"]["key"]) is None
    assert_no_leftovers(cluster)


def _watch(proc: subprocess.Popen, lines: list[str]) -> threading.Thread:
    def read():
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _owner_pids(builds: Path) -> set[int]:
    """The builder processes of the scratch dirs under ``builds`` (their owner files say)."""
    pids = set()
    for owner in builds.glob("*.owner"):
        try:
            pids.add(int(owner.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    return pids


def test_worker_killed_mid_build_is_retried_elsewhere(cluster):
    from envbuild.build.reaper import (
        OWNER_SUFFIX,
        bundle_container_ids,
        cgroup_dirs,
        reap_stale_builds,
    )
    from runtime_shim.isolation.runc import OciRuntime
    from runtime_shim.node.layout import NodeLayout

    names = synthetic_tree(cluster.defs, 8, sleep=4)
    victim = cluster.ray.add_node(resources={"envbuild_builder": 2})
    victim_id = cluster.ray.node_id(victim)
    victim_dir = Path(cluster.node_template.replace("{node_id}", victim_id))
    layout = NodeLayout(victim_dir)
    proc = subprocess.Popen(cluster.argv("--json"), env=cluster.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = _watch(proc, lines)
    builders: set[int] = set()
    cids: list[str] = []
    try:
        # The node's own scratch dirs say a step runs there: its progress line reaches the
        # driver's stderr up to a flush later, and on a slow machine the 4 s step could be
        # over (its scratch gone) by then.
        def running_step() -> bool:
            nonlocal builders, cids
            if not layout.builds.is_dir():
                return False
            builders = _owner_pids(layout.builds)
            cids = [c for d in layout.builds.iterdir() if d.is_dir()
                    for c in bundle_container_ids(d)]
            return bool(builders and cids)

        _wait_for(running_step, 240, "a step running on the added node")
        cluster.ray.kill_node(victim)
        # stdout in a thread of its own: stderr is the reader thread's (communicate() would
        # read and close it under that thread: lost lines, and a ValueError in the thread)
        assert proc.stdout is not None
        stdout = proc.stdout
        outs: list[str] = []
        out_reader = threading.Thread(target=lambda: outs.append(stdout.read()), daemon=True)
        out_reader.start()
        proc.wait(timeout=600)
        out_reader.join(30)
        out = "".join(outs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # The killed node's builders are Ray workers that outlive their raylet a little (they
        # exit when they notice it is gone, without cleaning up): wait for them, then reap
        # their leftovers as the next builder on that node cache does.
        _wait_for(lambda: not [p for p in builders if os.path.exists(f"/proc/{p}")], 60,
                  "the killed node's builder processes to exit")
        # (a builder that got to finish before it noticed cleaned up after itself). What is
        # left is each build's dir or its owner file alone: a builder stopped inside
        # release_scratch, between the tree's removal and the owner file's (a CI run of
        # 3a1a077 reaped such a name, with no dir, that a list of dirs did not have).
        left = sorted({d.name for d in layout.builds.iterdir() if d.is_dir()}
                      | {o.name.removesuffix(OWNER_SUFFIX)
                         for o in layout.builds.glob(f"*{OWNER_SUFFIX}")})
        reaped = reap_stale_builds(layout.builds, OciRuntime("runc", state_root=str(layout.runc)))
    reader.join(10)
    assert builders and cids, "the killed node was running a step"
    assert sorted(r.name for r in reaped) == left, (reaped, left)
    assert [d for c in cids for d in cgroup_dirs(c)] == []
    assert not [d for d in layout.builds.iterdir()], list(layout.builds.iterdir())
    assert proc.returncode == 0, "".join(lines[-40:])
    report = {o["name"]: o for o in json.loads(out)["layers"]}
    assert all(report[n]["status"] in ("built", "cached") for n in names)
    assert all(report[n]["node"] != victim_id[:8] for n in names if report[n]["status"] == "built")
    store = cluster.store()
    for n in names:
        rec = get_key_record(store, report[n]["key"])
        assert rec is not None and store.exists(rec.layer)  # the retry published, in full
    assert_no_leftovers(cluster)


def test_two_concurrent_builds_build_each_key_once(cluster):
    names = synthetic_tree(cluster.defs, 20, sleep=1)
    procs = [subprocess.Popen(cluster.argv("--json"), env=cluster.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    reports = [{o["name"]: o for o in json.loads(out)["layers"]} for out, _ in outs]
    for n in [*names, "busybox-tiny", "kvsh", "shtest"]:
        statuses = sorted(r[n]["status"] for r in reports)
        assert statuses == ["built", "cached"], (n, statuses)
    assert reports[0]["ws000"]["digest"] == reports[1]["ws000"]["digest"]
    assert_no_leftovers(cluster)


def test_ctrl_c_of_the_driver_cancels_the_tasks_and_publishes_nothing(cluster):
    names = synthetic_tree(cluster.defs, 6, sleep=30)
    proc = subprocess.Popen(cluster.argv(), env=cluster.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = _watch(proc, lines)
    try:
        _wait_for(lambda: sum(": step 1/1" in line and "ws" in line for line in lines) >= 2,
                  240, "two workspace steps running")
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        stopped_in = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    said = "".join(lines[-30:])
    assert proc.returncode != 0, said
    assert stopped_in < 30, said  # the 30 s sleeps were killed, not waited for
    store = cluster.store()
    ws_records = [n for n in store.list_records(KEY_RECORDS)]
    from envbuild.build.engine import load

    keys = load(cluster.defs).keys.layers
    assert not [n for n in names if keys[n][7:] in ws_records]  # nothing partial or whole
    _wait_for(lambda: store.list_records(LEASES) == [], 30,
              f"the cancelled tasks' leases; the driver said:\n{said}")
    _wait_for(lambda: all(not (d / "builds").exists() or not any((d / "builds").iterdir())
                          for d in cluster.node_dirs()), 60, "the cancelled builds' scratch")
    assert_no_leftovers(cluster)
