"""A task, compiled: its hidden layer as a layer job, and its task lock in the store (issue 35).

A Task's hidden layer is built by the executor that builds every layer (``build_layer``), from
the workspace ``envbuild.plan.taskplan`` makes of it, over the task env's layers; its key
record is published like any layer's, so ``plan`` shows it ``cached`` and a rebuild takes it.

The **task lock** (format: ``runtime_shim.node.tasklock``) is published after the env's lock:
its config is the ``TaskSpec`` made from the Task and the env lock's digest, its one layer the
hidden layer (from its key record), its ref ``task/NAME``, moved only when it changed (as
``env/NAME`` is). The hidden layer is in no env lock; only a task lock names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from envbuild.build.layerjob import LayerJob
from envbuild.defs.model import Task
from envbuild.errors import BuildError, RefNotFound
from envbuild.oci import MEDIA_TYPE_MANIFEST
from envbuild.plan.taskplan import HIDDEN_PIN, hidden_definition, hidden_name
from envbuild.store import KeyRecord, Store, get_key_record
from runtime_shim.node import TASK_REF_PREFIX, HiddenLayer, TaskSpec, publish_task


@dataclasses.dataclass(frozen=True)
class TaskOutcome:
    """A task after a build or a lock: its task lock's digest (None: not locked, ``error``
    says why), its ref, the env lock and the hidden layer it names."""

    task: str
    digest: str | None
    ref: str
    env_lock: str | None = None
    hidden: str | None = None
    error: str | None = None

    def to_json(self) -> dict[str, str | None]:
        return {"task": self.task, "digest": self.digest, "ref": self.ref,
                "env_lock": self.env_lock, "hidden": self.hidden, "error": self.error}


def task_of(ws, name: str) -> Task:
    """Task ``name`` of the snapshot ``ws``, or ``BuildError`` naming what it is."""
    d = ws.graph.defs.by_name.get(name)
    if not isinstance(d, Task):
        what = f"a {d.kind}" if d is not None else "not defined"
        raise BuildError(f"{name} is {what}, not a Task", hint="envbuild lock takes env or task names")
    return d


def hidden_job(ws, task_name: str) -> LayerJob:
    """The layer job of a task's hidden layer: its workspace over the env's layers
    (topmost first), with the task's pinned hidden source."""
    task = task_of(ws, task_name)
    key = ws.keys.tasks.get(task_name)
    if key is None:
        raise BuildError(f"{task_name}: its hidden source was not pinned",
                         hint="build from a working tree (not a git revision)")
    lowers = tuple(reversed(ws.graph.env_layers(task.env)))
    return LayerJob(name=hidden_name(task_name), key=key, definition=hidden_definition(task),
                    lower_keys=tuple(ws.keys.layers[n] for n in lowers),
                    pins={"source": ws.pinned[task_name][HIDDEN_PIN]}, build_env={})


def task_spec(task: Task, env_lock: str) -> TaskSpec:
    """The grading spec of ``task`` whose env lock is ``env_lock`` (the task lock's config)."""
    return TaskSpec(name=task.name, env_lock=env_lock, workdir=task.workdir, run=task.grade.run,
                    timeout=task.grade.timeout, env=dict(task.grade.env), user=task.grade.user,
                    editable=task.editable, must_pass=task.must_pass,
                    keep_passing=task.keep_passing, junit=task.junit, allow=task.allow)


def hidden_layer(record: KeyRecord) -> HiddenLayer:
    """The task lock's descriptor of a hidden layer built under ``record``."""
    return HiddenLayer(digest=record.layer, size=record.size, diff_id=record.diff_id,
                       toc_digest=record.toc)


def publish_task_locks(ws, store: Store, env_locks: Mapping[str, str],
                       names: Iterable[str]) -> dict[str, TaskOutcome]:
    """Store the task lock of each task of ``names`` whose env is locked (``env_locks``: env
    name -> lock digest) and whose hidden layer is built, then move the ``task/NAME`` refs
    that changed in one ``put_refs``; an outcome for each (``error`` for the others)."""
    out: dict[str, TaskOutcome] = {}
    for name in names:
        task, ref = task_of(ws, name), TASK_REF_PREFIX + name
        env_lock = env_locks.get(task.env)
        key = ws.keys.tasks.get(name)
        record = get_key_record(store, key) if key is not None else None
        if env_lock is None or record is None:
            why = (f"its env {task.env} is not locked" if env_lock is None
                   else "its hidden layer is not built")
            out[name] = TaskOutcome(name, None, ref, env_lock, error=f"not locked: {why}")
            continue
        digest = publish_task(store, task_spec(task, env_lock), hidden_layer(record))
        out[name] = TaskOutcome(name, digest, ref, env_lock, record.layer)
    moved = {}
    for o in out.values():
        if o.digest is not None:
            try:
                current = store.get_ref(o.ref).digest
            except RefNotFound:
                current = None
            if current != o.digest:
                moved[o.ref] = o.digest
    if moved:
        store.put_refs(moved, media_type=MEDIA_TYPE_MANIFEST)
    return out
