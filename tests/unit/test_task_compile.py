"""A Task compiled (issue 35 item 1), the pure parts: the hidden layer's key, the plan's task
steps, the task spec made from a Task, and what gc and sync reach from a task lock (its env
lock by annotation) in a memory store. Real builds: tests/integration/test_task_lock.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from envbuild.build.taskbuild import hidden_layer, publish_task_locks, task_spec
from envbuild.defs.model import GitSource, Origin, PathSource, Task, Workspace
from envbuild.errors import StoreError
from envbuild.jobs import (
    JobManifestError,
    parse_job_manifest,
    render_job_manifest,
    resolve_job_manifest,
    verify_job_manifest,
)
from envbuild.jobs.model import SandboxGroup
from envbuild.layers import pack_to_store
from envbuild.oci import MEDIA_TYPE_MANIFEST
from envbuild.plan.keys import layer_key
from envbuild.plan.planner import TaskPlan
from envbuild.plan.taskplan import hidden_definition, hidden_key, hidden_key_inputs, hidden_name
from envbuild.store import KeyRecord, MemoryStore, digest_bytes, put_bytes, put_key_record
from envbuild.store.gc import gc
from envbuild.store.sync import sync, walk
from runtime_shim.node import load_task, publish_task
from tests.unit.test_gc_property import age_everything, make_lock
from tests.unit.test_jobs_support import make_env

ORIGIN = Origin(file="envdefs/tasks/t.yaml", line=1, column=1)
PIN = {"hidden": "sha256:" + "a" * 64}
LOWERS = ["sha256:" + "b" * 64, "sha256:" + "c" * 64]


def task(**kw) -> Task:
    fields = {"name": "t", "origin": ORIGIN, "env": "e", "workdir": "/workspace",
              "hidden": PathSource("hidden")}
    return Task(**{**fields, **kw})


def key(t: Task, pins=PIN, lowers=LOWERS) -> str:
    return hidden_key(hidden_key_inputs(t, pins, lowers))


# ---------------------------------------------------------------------- the hidden layer's key


def test_the_hidden_key_depends_on_content_workdir_and_lowers_only():
    base = key(task())
    assert key(task(), {"hidden": "sha256:" + "d" * 64}) != base  # the hidden files
    assert key(task(workdir="/src")) != base                       # where they land
    assert key(task(), lowers=LOWERS[:1]) != base                   # the env below them
    assert key(task(hidden=GitSource(url="../r.git", rev="v1"))) != base
    # not the task's name, env name or grading spec: two tasks may share one hidden blob
    assert key(task(name="other", env="other-env")) == base
    assert key(task(junit="/tmp/j.xml", must_pass=("a",))) == base


def test_the_hidden_key_never_equals_the_same_workspaces_key():
    t = task()
    ws = hidden_definition(t)
    assert isinstance(ws, Workspace) and (ws.dest, ws.source, ws.steps) == (
        "/workspace", PathSource("hidden"), ())
    inputs = hidden_key_inputs(t, PIN, LOWERS)
    assert layer_key(inputs) != hidden_key(inputs)  # its own tag


def test_the_hidden_name_is_no_definition_name():
    assert hidden_name("t") == "t:hidden"  # ':' is outside the definition name pattern


def test_a_task_plan_becomes_a_step_over_its_env_layers():
    plan = TaskPlan(name="t", env="e", key=PIN["hidden"], status="missing",
                    depends_on=("base", "ws"))
    step = plan.step()
    assert (step.name, step.kind, step.key, step.depends_on, step.status) == (
        "t:hidden", "Task", PIN["hidden"], ("base", "ws"), "missing")
    assert plan.to_json() == {"name": "t", "env": "e", "hidden": {
        "name": "t:hidden", "key": PIN["hidden"], "status": "missing"}}


# ---------------------------------------------------------------------- the task lock


def test_the_task_spec_carries_every_grading_field():
    from envbuild.defs.model import Grade

    t = task(grade=Grade(run="pytest", timeout=5, env={"A": "1"}, user="1000"),
             editable=("/workspace/src",), must_pass=("x",), keep_passing=("y",),
             junit="/tmp/j.xml", allow=("/workspace/setup.cfg",))
    spec = task_spec(t, LOWERS[0])
    assert spec.to_json() == {
        "version": "envbuild.task.v1", "name": "t", "env_lock": LOWERS[0],
        "workdir": "/workspace",
        "grade": {"run": "pytest", "timeout": 5, "env": {"A": "1"}, "user": "1000"},
        "editable": ["/workspace/src"], "tests": {"must_pass": ["x"], "keep_passing": ["y"]},
        "junit": "/tmp/j.xml", "allow": ["/workspace/setup.cfg"]}


def stored_task(store: MemoryStore) -> tuple[str, str, str, str]:
    """(task lock, its env lock, the env's layer, the hidden layer) in ``store``."""
    layer = put_bytes(store, b"env layer")
    env = make_lock(store, [layer])
    hidden = put_bytes(store, b"hidden layer")
    record = KeyRecord(layer=hidden, toc=digest_bytes(b"t"), diff_id=digest_bytes(b"d"),
                       size=store.stat(hidden).size)
    digest = publish_task(store, task_spec(task(), env), hidden_layer(record), ref="task/t")
    return digest, env, layer, hidden


def test_gc_keeps_the_env_lock_a_task_ref_reaches():
    store = MemoryStore()
    digest, env, layer, hidden = stored_task(store)  # no env/ ref: the task ref alone
    age_everything(store)
    gc(store, grace=0)
    assert all(store.exists(d) for d in (digest, env, layer, hidden))
    store.delete_ref("task/t")
    gc(store, grace=0)
    assert not any(store.exists(d) for d in (digest, env, layer, hidden))


def test_gc_keeps_what_a_job_manifests_task_lock_reaches():
    """``gc --job``: a resolved task group's blobs (task lock first) are roots."""
    store = MemoryStore()
    digest, env, layer, hidden = stored_task(store)
    store.delete_ref("task/t")
    group = SandboxGroup(lock=env, task=digest)
    age_everything(store)
    gc(store, grace=0, roots=group.blobs())
    assert all(store.exists(d) for d in (digest, env, layer, hidden))


def test_sync_takes_the_env_lock_with_the_task_lock():
    src, dst = MemoryStore(), MemoryStore()
    digest, env, layer, hidden = stored_task(src)
    blobs, _ = walk(src, {"mediaType": MEDIA_TYPE_MANIFEST, "digest": digest})
    order = [d for d, _ in blobs]
    assert order.index(env) < order.index(digest)  # the env lock before the task lock
    sync(src, dst, refs=["task/t"])
    assert all(dst.exists(d) for d in (digest, env, layer, hidden))
    lock = load_task(dst, "t")
    assert (lock.digest, lock.spec.env_lock, lock.hidden.digest) == (digest, env, hidden)


def test_publish_task_locks_says_why_a_task_is_not_locked(tmp_path: Path):
    class Keys:
        tasks = {"t": "sha256:" + "e" * 64}

    class Graph:
        class defs:  # noqa: N801  the shape of a DefinitionSet
            by_name = {"t": task()}

    class Ws:
        keys, graph = Keys, Graph

    store = MemoryStore()
    got = publish_task_locks(Ws, store, {}, ["t"])["t"]
    assert (got.digest, got.error) == (None, "not locked: its env e is not locked")
    got = publish_task_locks(Ws, store, {"e": LOWERS[0]}, ["t"])["t"]
    assert got.error == "not locked: its hidden layer is not built"
    layer = put_bytes(store, b"hidden")
    put_key_record(store, Keys.tasks["t"], KeyRecord(layer=layer, toc=digest_bytes(b"t"),
                                                     diff_id=digest_bytes(b"d"), size=6))
    got = publish_task_locks(Ws, store, {"e": LOWERS[0]}, ["t"])["t"]
    assert got.error is None and store.get_ref("task/t").digest == got.digest
    assert load_task(store, got.digest).hidden.digest == layer == got.hidden


# ---------------------------------------------------------------------- job manifests


def test_a_job_group_may_name_a_task_and_keeps_its_digest():
    group = SandboxGroup.from_mapping({"task": "kv-task", "count": 2})
    assert (group.lock, group.task, group.label, group.resolved) == ("", "kv-task", "kv-task",
                                                                     False)
    assert "lock" not in group.to_mapping() and group.to_mapping()["task"] == "kv-task"
    resolved = SandboxGroup.from_mapping({**group.to_mapping(), "task": LOWERS[1],
                                          "lock": LOWERS[0],
                                          "pinned": {"config": LOWERS[0], "layers": []}})
    assert resolved.resolved and resolved.blobs()[:2] == [LOWERS[1], LOWERS[0]]


JOB = """\
apiVersion: envbuild/v1
kind: JobManifest
groups:
  - {name: agents, task: TASK, count: 2}
"""


def stored_task_over(store: MemoryStore, tmp_path: Path) -> tuple[str, str]:
    """A task lock ``task/t`` over the runnable env lock ``env/alpha``, its hidden layer a
    real one: (task, env) digests."""
    make_env(store, tmp_path, "alpha", [{"etc/a": b"a"}])
    env = store.get_ref("env/alpha").digest
    (tmp_path / "hidden" / "workspace").mkdir(parents=True)
    (tmp_path / "hidden" / "workspace" / "test_hidden.py").write_text("def test(): pass\n")
    info = pack_to_store(tmp_path / "hidden", store)
    record = KeyRecord(layer=info.digest, toc=info.toc_digest, diff_id=info.diff_id,
                       size=info.size)
    return publish_task(store, task_spec(task(), env), hidden_layer(record), ref="task/t"), env


def test_job_resolve_of_a_task_group_pins_its_env_lock_and_keeps_the_task(tmp_path):
    store = MemoryStore()
    digest, env = stored_task_over(store, tmp_path)
    for name in ("t", "task/t", digest):
        m = resolve_job_manifest(parse_job_manifest(JOB.replace("TASK", name)), store)
        [group] = m.groups
        assert (group.task, group.lock, group.resolved) == (digest, env, True)
        assert group.pinned is not None and group.pinned.ref == (
            None if name == digest else "task/t")
        assert m.blobs()[:2] == [digest, env]
        again = resolve_job_manifest(parse_job_manifest(render_job_manifest(m)), store)
        assert render_job_manifest(again) == render_job_manifest(m)  # resolves to itself
    # a lock that names a task lock makes a task group too
    [group] = resolve_job_manifest(parse_job_manifest(
        JOB.replace("task: TASK", "lock: task/t")), store).groups
    assert (group.task, group.lock) == (digest, env) and group.pinned.ref == "task/t"
    report = verify_job_manifest(m, store)
    assert report.ok and report.checked == 6  # env and task: lock, config, layer each
    lock = load_task(store, digest)
    store.delete(lock.hidden.digest)
    assert [(p.kind, p.name, p.status) for p in verify_job_manifest(m, store).problems] == [
        ("layer", lock.hidden.digest, "missing")]
    store.delete(digest)
    assert [(p.kind, p.name, p.status) for p in verify_job_manifest(m, store).problems] == [
        ("lock", digest, "missing")]


def test_a_task_group_naming_another_env_lock_is_refused(tmp_path):
    store = MemoryStore()
    make_env(store, tmp_path, "beta", [{"etc/b": b"b"}])
    stored_task_over(store, tmp_path)
    text = JOB.replace("task: TASK", "task: t, lock: env/beta")
    with pytest.raises(StoreError) as info:
        resolve_job_manifest(parse_job_manifest(text), store)
    assert "is not the env lock of task lock" in info.value.context
    [group] = resolve_job_manifest(parse_job_manifest(  # the task's own env lock, by ref: fine
        JOB.replace("task: TASK", "task: t, lock: env/alpha")), store).groups
    assert group.lock == store.get_ref("env/alpha").digest


def test_a_job_group_needs_a_lock_or_a_task():
    with pytest.raises(JobManifestError):
        parse_job_manifest(JOB.replace("task: TASK, ", ""))


def test_export_refuses_a_task_lock_and_names_its_env_lock(tmp_path):
    from envbuild.export import ExportRequest, export_lock, parse_target

    store = MemoryStore()
    _digest, env, _layer, _hidden = stored_task(store)
    with pytest.raises(StoreError) as info:
        export_lock(store, ExportRequest("task/t", parse_target(f"oci:{tmp_path / 'out'}"),
                                         None))
    assert "task/t is a task lock" in info.value.message and env in info.value.message
    assert "envbuild push task/t --to DIR" in (info.value.hint or "")
    assert not (tmp_path / "out").exists()
