"""A Task compiled to a task lock (issue 35 item 1): real builds, a real store, real runc.

A small task on the busybox env (``kv-task``: the kvsh workspace at ``/workspace``, a hidden
test at ``/workspace/tests/test_hidden.sh``) is built and locked with the real CLI; the task
lock is read back with ``load_task``, its env lock is the one ``lock ENV`` writes, the hidden
file is in the hidden layer and in no layer of the env lock, a sandbox made from the task ref
does not see it, a rebuild writes the same task lock, gc keeps what the task ref reaches and
drops the hidden layer once the ref is gone, and a job manifest may name the task.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from envbuild.layers import LayerReader
from envbuild.store import LocalStore, get_json
from runtime_shim import Sandbox
from runtime_shim.node import load_task
from tests.conftest import require_root, require_tool
from tests.integration.conftest import copy_busybox_defs
from tests.store.registry_server import running_registry
from tests.store.s3server import moto_s3, s3_env  # noqa: F401

pytestmark = pytest.mark.integration

TASK = """\
apiVersion: envbuild/v1
kind: Task
name: kv-task
env: busybox-shell
workdir: /workspace
hidden: {path: hidden}
editable: [bin, lib]
allow: [tests/settings.cfg]
grade: {run: sh tests/test_hidden.sh, timeout: 30, env: {CI: "1"}}
tests: {must_pass: [kv.hidden]}
junit: /tmp/grade/junit.xml
"""
HIDDEN = "tests/test_hidden.sh"


class Cli:
    """The real CLI in a fresh process (as a user runs it) on one tree, store and node."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "ENVBUILD_NODE_CACHE": str(self.root / "node"),
               "ENVBUILD_STORE": str(self.root / "store"),
               "ENVBUILD_DEFS": str(self.root / "envdefs")}
        proc = subprocess.run([sys.executable, "-m", "envbuild.cli", *args], env=env,
                              capture_output=True, text=True, timeout=600)
        if ok:
            assert proc.returncode == 0, proc.stderr
        return proc

    def json(self, *args: str) -> dict:
        return json.loads(self(*args, "--json").stdout)

    @property
    def store(self) -> LocalStore:
        return LocalStore(self.root / "store")


def write_task(defs: Path) -> None:
    (defs / "tasks" / "hidden" / "tests").mkdir(parents=True)
    (defs / "tasks" / "kv-task.yaml").write_text(TASK)
    (defs / "tasks" / "hidden" / HIDDEN).write_text("echo hidden-test-ran\n")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Cli, dict]:
    """The busybox env and kv-task built once: (the CLI, ``build --json``'s report)."""
    require_root()
    require_tool("runc")
    require_tool("busybox")
    root = tmp_path_factory.mktemp("task")
    copy_busybox_defs(root / "envdefs")
    write_task(root / "envdefs")
    cli = Cli(root)
    return cli, json.loads(cli("build", "--json").stdout)


def layer_entries(store: LocalStore, digest: str) -> dict:
    with LayerReader.open_file(store.blob_path(digest)) as r:
        return {e.path.strip("/"): e for e in r.entries()}


def layer_paths(store: LocalStore, digest: str) -> set[str]:
    return set(layer_entries(store, digest))


def test_build_builds_the_hidden_layer_and_writes_the_task_lock(built):
    cli, report = built
    hidden = [o for o in report["layers"] if o["name"] == "kv-task:hidden"]
    assert [(o["kind"], o["status"]) for o in hidden] == [("Task", "built")]
    [task] = report["tasks"]
    assert (task["task"], task["ref"], task["error"]) == ("kv-task", "task/kv-task", None)
    store = cli.store
    assert store.get_ref("task/kv-task").digest == task["digest"]
    lock = load_task(store, "task/kv-task")
    assert lock.digest == task["digest"] and lock.hidden.digest == hidden[0]["digest"]
    spec = lock.spec
    assert spec.env_lock == store.get_ref("env/busybox-shell").digest == task["env_lock"]
    assert (spec.name, spec.workdir, spec.run, spec.timeout, dict(spec.env)) == (
        "kv-task", "/workspace", "sh tests/test_hidden.sh", 30.0, {"CI": "1"})
    assert spec.editable == ("/workspace/bin", "/workspace/lib")
    assert spec.allow == ("/workspace/tests/settings.cfg",)
    assert (spec.must_pass, spec.junit) == (("kv.hidden",), "/tmp/grade/junit.xml")


def test_plan_shows_the_hidden_layer_cached(built):
    cli, report = built
    [task] = cli.json("plan", "kv-task")["tasks"]
    hidden = next(o for o in report["layers"] if o["name"] == "kv-task:hidden")
    assert task["hidden"] == {"name": "kv-task:hidden", "key": hidden["key"], "status": "cached"}
    assert f"cached  kv-task  busybox-shell  kv-task:hidden  {hidden['key'][:19]}" in \
        cli("plan").stdout


def test_lock_task_locks_its_env_as_lock_env_does(built):
    cli, report = built
    env_lock = cli.json("lock", "busybox-shell")["locks"][0]["digest"]
    got = cli.json("lock", "kv-task")
    assert got == {"task": "kv-task", "digest": report["tasks"][0]["digest"],
                   "env_lock": env_lock, "hidden": load_task(cli.store, "kv-task").hidden.digest}
    assert cli("lock", "kv-task").stdout == f"kv-task {got['digest']}\n"


def test_the_hidden_file_is_in_the_hidden_layer_and_in_no_env_layer(built):
    cli, _ = built
    store = cli.store
    lock = load_task(store, "task/kv-task")
    # the hidden files and the directories they are in (copied up from the env's layers,
    # with their owners and modes), nothing else
    assert layer_paths(store, lock.hidden.digest) == {"workspace", "workspace/tests",
                                                      f"workspace/{HIDDEN}"}
    env = get_json(store, lock.spec.env_lock)
    assert env["layers"] and lock.hidden.digest not in {x["digest"] for x in env["layers"]}
    for layer in env["layers"]:
        assert f"workspace/{HIDDEN}" not in layer_paths(store, layer["digest"])
    # its directories below workdir are the env's (owner, mode): laid over the agent's work,
    # they change nothing but the files they hold (workdir takes the hidden dir's mode, as a
    # workspace's dest takes its source's)
    hidden = layer_entries(store, lock.hidden.digest)
    below = {}
    for layer in env["layers"]:
        below.update(layer_entries(store, layer["digest"]))
    for d in ("workspace/tests",):
        assert (hidden[d].mode, hidden[d].uid, hidden[d].gid) == (
            below[d].mode, below[d].uid, below[d].gid)


def test_a_sandbox_from_the_task_ref_does_not_see_the_hidden_file(built):
    cli, _ = built
    with Sandbox.create("task/kv-task", store=cli.store, node_dir=cli.root / "node") as sb:
        assert sb.lock.digest == load_task(cli.store, "kv-task").spec.env_lock
        assert sb.exec("ls /workspace/tests").exit_code == 0
        assert sb.exec(f"test -e /workspace/{HIDDEN}").exit_code == 1


def test_a_rebuild_writes_the_same_task_lock(built):
    cli, report = built
    again = json.loads(cli("build", "--json", "--no-cache", "kv-task").stdout)
    assert {o["status"] for o in again["layers"]} == {"built"}
    assert again["tasks"] == report["tasks"]


def test_gc_keeps_what_a_task_ref_reaches_and_drops_the_hidden_layer_without_it(tmp_path):
    """Its own tree: the ref is deleted here."""
    require_root()
    require_tool("runc")
    copy_busybox_defs(tmp_path / "envdefs")
    write_task(tmp_path / "envdefs")
    cli = Cli(tmp_path)
    cli("build", "kv-task")
    store = cli.store
    lock = load_task(store, "kv-task")
    env = get_json(store, lock.spec.env_lock)
    reached = {lock.digest, lock.hidden.digest, lock.spec.env_lock, env["config"]["digest"],
               *(x["digest"] for x in env["layers"])}
    reached.add(get_json(store, lock.digest)["config"]["digest"])
    store.delete_ref("env/busybox-shell")  # the task ref alone keeps the env lock
    cli("gc", "--grace", "0", "--drop-cache")
    assert all(store.exists(d) for d in reached)
    assert load_task(store, "kv-task").spec.env_lock == lock.spec.env_lock
    store.delete_ref("task/kv-task")
    cli("gc", "--grace", "0", "--drop-cache")
    assert not store.exists(lock.hidden.digest) and not store.exists(lock.digest)


def test_a_job_manifest_names_the_task(built, tmp_path):
    cli, report = built
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent("""\
        apiVersion: envbuild/v1
        kind: JobManifest
        groups:
          - {name: agents, task: kv-task, count: 1, limits: {pids: 64}}
        """))
    out = tmp_path / "job.resolved.yaml"
    cli("job", "resolve", str(job), "-o", str(out))
    from envbuild.jobs import create_sandbox, load_job_manifest

    [group] = load_job_manifest(out).groups
    assert group.task == report["tasks"][0]["digest"]
    assert group.lock == report["tasks"][0]["env_lock"]
    assert group.pinned is not None and group.pinned.ref == "task/kv-task"
    assert cli("job", "verify", str(out)).returncode == 0
    with create_sandbox(group, store=cli.store, node_dir=cli.root / "node") as sb:
        assert sb.lock.digest == group.lock
        assert sb.exec(f"test -e /workspace/{HIDDEN}").exit_code == 1


def pushed_then_pulled(cli: Cli, url: str, tmp_path: Path) -> LocalStore:
    """``push kv-task --to URL`` from the built store, ``pull task/kv-task --from URL`` into
    a fresh one; the fresh store."""
    cli("push", "kv-task", "--to", url)
    fresh = tmp_path / "fresh-store"
    cli("--store", str(fresh), "pull", "task/kv-task", "--from", url)
    return LocalStore(fresh)


def check_pulled(cli: Cli, fresh: LocalStore) -> None:
    """The pulled store holds the task lock, its spec, hidden layer, env lock and its layers:
    a grader there needs nothing else; a sandbox from the task ref runs."""
    from runtime_shim.node import resolve

    built = load_task(cli.store, "kv-task")
    lock = load_task(fresh, "task/kv-task")
    assert (lock.digest, lock.spec, lock.hidden) == (built.digest, built.spec, built.hidden)
    assert fresh.exists(lock.hidden.digest)
    env = resolve(fresh, "task/kv-task")
    assert env.digest == lock.spec.env_lock and all(fresh.exists(x.digest) for x in env.layers)
    with Sandbox.create("task/kv-task", store=fresh, node_dir=cli.root / "node") as sb:
        assert sb.exec("test -x /workspace/bin/kv").exit_code == 0
        assert sb.exec(f"test -e /workspace/{HIDDEN}").exit_code == 1


def test_push_and_pull_a_task_through_a_registry(built, tmp_path):
    cli, _ = built
    with running_registry(tmp_path / "registry") as registry:
        fresh = pushed_then_pulled(cli, registry.url("team/tasks"), tmp_path)
    check_pulled(cli, fresh)


def test_push_and_pull_a_task_through_s3(built, s3_env, tmp_path):  # noqa: F811  (fixture)
    cli, _ = built
    fresh = pushed_then_pulled(cli, f"s3://{s3_env.make_bucket()}/tasks", tmp_path)
    check_pulled(cli, fresh)


def test_push_a_task_into_an_oci_layout_directory(built, tmp_path):
    """export refuses a task lock (not an image) and says to push it into a layout: that
    layout (a local store) then holds all a grader needs."""
    cli, _ = built
    refused = cli("export", "kv-task", "--to", f"oci:{tmp_path / 'x'}", ok=False)
    assert refused.returncode == 1 and "is a task lock" in refused.stderr
    cli("push", "task/kv-task", "--to", str(tmp_path / "layout"))
    check_pulled(cli, LocalStore(tmp_path / "layout"))


def test_a_second_machine_takes_the_hidden_layer_from_the_build_cache(s3_env, tmp_path):  # noqa: F811
    """--cache-to pushes the hidden layer's key record and the task ref; --cache-from on an
    empty machine builds nothing and writes the same task lock."""
    require_root()
    require_tool("runc")
    url = f"s3://{s3_env.make_bucket()}/cache"
    a, b = Cli(tmp_path / "a"), Cli(tmp_path / "b")
    for cli in (a, b):
        copy_busybox_defs(cli.root / "envdefs")
        write_task(cli.root / "envdefs")
    first = json.loads(a("--cache-to", url, "build", "kv-task", "--json").stdout)
    again = json.loads(b("--cache-from", url, "build", "kv-task", "--json").stdout)
    assert {o["status"] for o in again["layers"]} == {"cached"}
    assert again["tasks"] == first["tasks"]
    assert not (b.root / "node" / "builds").exists() or \
        not any((b.root / "node" / "builds").iterdir())
    check_pulled(a, LocalStore(b.root / "store"))
