"""``envbuild build`` and ``envbuild lock`` as library calls: plan, build what is missing, lock.

A task's hidden layer is one more layer job (``envbuild.build.taskbuild``), and its task lock is
published after its env's lock.

Order of publication is the safety argument: a layer's blob is stored (verified) before its key
record; a lock's config and manifest blobs are stored before its ref (a task lock's, after its
env lock's). A crash at any point
leaves, at worst, unreferenced blobs for GC, never a record or ref pointing at nothing.

Across processes on one host, a layer key is built by one process at a time: the builder holds
``<node>/locks/key-<hex>.lock`` and re-checks the store's key record after taking it, so the
second ``envbuild build`` finds the first one's result instead of building again. Across hosts
sharing a store (S3), the builder also holds the store's lease on the key
(``envbuild.store.lease``): a builder elsewhere waits for the key record instead of building.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from envbuild.build.executor import (
    BuildContext,
    BuildEvent,
    LayerJob,
    Progress,
    build_layer,
    sweep_stale_scratch,
)
from envbuild.build.pin import Snapshot, snapshot
from envbuild.build.scheduler import run_dag
from envbuild.build.taskbuild import TaskOutcome, hidden_job, publish_task_locks, task_of
from envbuild.defs.model import Base, Config, Env
from envbuild.errors import BuildError, EnvbuildError, RefNotFound, bug
from envbuild.plan.graph import EnvGraph
from envbuild.plan.lockspec import Lock, LockLayer, RuntimeConfig, make_lock, merge_config
from envbuild.plan.planner import BuildPlan, make_plan
from envbuild.store import MEDIA_TYPE_CONFIG, MEDIA_TYPE_MANIFEST, KeyRecord, Store, get_key_record, put_json

ROLE_OF_KIND = {"Base": "base", "Workspace": "workspace", "Toolkit": "toolkit"}


@dataclasses.dataclass(frozen=True)
class LayerOutcome:
    name: str
    kind: str
    key: str
    status: str  # built | cached | failed | skipped
    record: KeyRecord | None = None
    seconds: float = 0.0
    error: EnvbuildError | None = None
    blocked_by: str | None = None
    node: str = ""  # the Ray node that built it (``--executor ray``); "" otherwise


@dataclasses.dataclass(frozen=True)
class LockOutcome:
    env: str
    digest: str | None
    ref: str
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class BuildReport:
    """The layers (tasks' hidden layers last, kind ``Task``), env locks and task locks."""

    layers: tuple[LayerOutcome, ...]
    locks: tuple[LockOutcome, ...]
    tasks: tuple[TaskOutcome, ...] = ()

    @property
    def failed(self) -> list[LayerOutcome]:
        return [o for o in self.layers if o.status == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed and all(o.status != "skipped" for o in self.layers) and \
            all(lk.digest for lk in self.locks) and all(t.digest for t in self.tasks)


def load(defs_dir: Path) -> Snapshot:
    """Load, check, pin and key a definition tree (what every build command starts from)."""
    return snapshot(defs_dir)


def plan_with_store(ws: Snapshot, store: Store | None, targets: Iterable[str] | None = None,
                    records: dict[str, KeyRecord] | None = None) -> BuildPlan:
    """The plan against ``store``; ``records`` (if given) collects the key records found."""
    if store is None:
        return make_plan(ws.graph, ws.pinned, None, targets, keys=ws.keys)

    def lookup(key: str) -> KeyRecord | None:
        record = get_key_record(store, key)
        if records is not None and record is not None:
            records[key] = record
        return record

    return make_plan(ws.graph, ws.pinned, lookup, targets, keys=ws.keys)


def _lower_names(graph: EnvGraph, name: str) -> tuple[str, ...]:
    """The layers ``name`` is built on, topmost first."""
    d = graph[name]
    if isinstance(d, Base):
        return tuple(reversed(graph.base_chain(d.parent))) if d.parent else ()
    return tuple(reversed(graph.base_chain(d.build_on)))  # type: ignore[union-attr]


def _build_env(graph: EnvGraph, lower_names: tuple[str, ...]) -> dict[str, str]:
    configs = [_runtime_config(graph.layer(n).config) for n in reversed(lower_names)]
    return dict(merge_config(configs).env)


def _runtime_config(c: Config) -> RuntimeConfig:
    return RuntimeConfig(env=dict(c.env), workdir=c.workdir, user=c.user, cmd=c.cmd,
                         hostname=c.hostname)


def make_jobs(ws: Snapshot, names: Iterable[str]) -> dict[str, LayerJob]:
    """The layer job of each step name of a plan (a layer, or a task's hidden layer)."""
    jobs = {}
    for n in names:
        if n not in ws.graph.defs.by_name:  # <task>:hidden (envbuild.plan.taskplan)
            jobs[n] = hidden_job(ws, n.rpartition(":")[0])
            continue
        lowers = _lower_names(ws.graph, n)
        jobs[n] = LayerJob(name=n, key=ws.keys.layers[n], definition=ws.graph[n],  # type: ignore[arg-type]
                           lower_keys=tuple(ws.keys.layers[x] for x in lowers),
                           pins=ws.pinned.get(n, {}), build_env=_build_env(ws.graph, lowers))
    return jobs


class _KeyLock:
    """An exclusive flock per layer key, so two processes never build one key at once.

    Waiting for another process's build polls ``cancelled``: a blocking flock on a pool thread
    could not be interrupted by Ctrl-C."""

    def __init__(self, root: Path, key: str, cancelled: threading.Event) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.path = root / f"key-{key.removeprefix('sha256:')}.lock"
        self.cancelled = cancelled

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if self.cancelled.wait(0.1):
                    os.close(self.fd)
                    raise BuildError("cancelled while waiting for another build of this layer") from None

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def build_under_lease(ctx: BuildContext, job: LayerJob, progress: Progress, *,
                      no_cache: bool = False) -> KeyRecord | tuple[KeyRecord]:
    """Build ``job`` holding the store's lease on its key (``envbuild.store.lease``).

    Returns the key record another builder published while this one waited for its lease
    (bare), or ``(record,)`` for a layer this call built. The caller has just looked for the
    key record (and found none)."""
    from envbuild.store.lease import claim

    got = claim(ctx.store, job.key, ttl=ctx.lease_ttl, cancelled=ctx.cancelled,
                label=ctx.lease_label, ignore_existing=no_cache, checked=True,
                on_wait=lambda held: progress(BuildEvent(
                    job.name, "waiting", detail=f"for another builder ({held.get('host', '?')})")))
    if isinstance(got, KeyRecord):
        return got
    with got:
        return (build_layer(ctx, job, progress),)


def build(
    ws: Snapshot,
    ctx: BuildContext,
    targets: Iterable[str] | None = None,
    *,
    jobs: int = 2,
    no_cache: bool = False,
    progress: Progress = lambda e: None,
    cache_from: Store | None = None,
    cache_to: Store | None = None,
) -> BuildReport:
    """Build every missing layer of ``targets`` (default: everything) and lock every env.

    ``cache_from`` / ``cache_to``: a remote build cache (another store, e.g. S3) consulted for
    missing layers before building, and pushed to afterwards (``envbuild.store.sync``)."""
    # private dockerds of builds that were killed before they could clean up (issue 17), first:
    # their data roots are on those builds' scratch disks (issue 34, item 4)
    from envbuild.dockerd import sweep_stale_daemons

    sweep_stale_daemons(ctx.node.root / "dockerd")
    # then the scratch dirs of those builds (issue 11, item 14)
    sweep_stale_scratch(ctx.scratch_root, ctx.runtime)
    # Layers another machine built (cache_from) are pulled first: blob, then key record, into
    # ctx.store; the re-plan then marks them cached (logic in envbuild.store.sync).
    plan = prepare_plan(ws, ctx.store, targets, no_cache=no_cache, cache_from=cache_from)
    to_build = [s for s in plan.steps if no_cache or s.status == "missing"]
    outcomes = cached_outcomes(plan, ctx.store, to_build, progress)
    for s in to_build:
        progress(BuildEvent(s.name, "queued"))
    layer_jobs = make_jobs(ws, [s.name for s in to_build])

    def tracked(name: str) -> tuple[KeyRecord, str, float]:
        try:
            record, status, seconds = _build_one(ws, ctx, layer_jobs[name], progress, no_cache)
        except EnvbuildError as e:
            progress(BuildEvent(name, "failed", detail=e.message))
            raise
        progress(BuildEvent(name, "done" if status == "built" else "cached", seconds=seconds))
        return record, status, seconds

    results = run_dag([s.name for s in to_build], {s.name: s.depends_on for s in to_build},
                      tracked, key_of=lambda n: layer_jobs[n].key, jobs=jobs,
                      on_skip=lambda name, because: progress(
                          BuildEvent(name, "skipped", detail=f"{because} failed")),
                      cancelled=ctx.cancelled)
    for s in to_build:
        outcomes[s.name] = _outcome_of(s, results[s.name])
    return finish_build(ws, ctx.store, plan, outcomes, cache_to)


def cached_outcomes(plan: BuildPlan, store: Store, to_build: list, progress: Progress,
                    records: dict[str, KeyRecord] | None = None) -> dict[str, LayerOutcome]:
    """The outcomes of the plan's layers not in ``to_build`` (cached: their key record from
    ``records`` or the store), each reported to ``progress``."""
    outcomes: dict[str, LayerOutcome] = {}
    for s in plan.steps:
        if s not in to_build:
            record = (records or {}).get(s.key) or get_key_record(store, s.key)
            outcomes[s.name] = LayerOutcome(s.name, s.kind, s.key, "cached", record=record)
            progress(BuildEvent(s.name, "cached"))
    return outcomes


def _build_one(ws: Snapshot, ctx: BuildContext, job: LayerJob, progress: Progress,
               no_cache: bool) -> tuple[KeyRecord, str, float]:
    """Build one layer of a local build under its key's lock file and lease: (record, "built"
    or "cached" when another builder published it meanwhile, seconds)."""
    started = time.monotonic()
    if ctx.cancelled.is_set():  # queued before the interrupt: do not start
        raise BuildError(f"{job.name}: cancelled", hint="nothing was published for this layer")
    with _KeyLock(ctx.node.root / "locks", job.key, ctx.cancelled):
        existing = None if no_cache else get_key_record(ctx.store, job.key)
        if existing is not None:  # another process built it while we waited
            return existing, "cached", 0.0
        # a Dockerfile base on an env of this tree (FROM envbuild.invalid/env/E): E's
        # layers are built (they are its dependencies), so lock E now, from this plan's
        # keys, for the build to load
        envs = getattr(getattr(job.definition, "source", None), "envs", ())
        if envs:
            publish_locks(ws, ctx.store, envs)
        got = build_under_lease(ctx, job, progress, no_cache=no_cache)
    if isinstance(got, KeyRecord):  # another builder (another host) published it
        return got, "cached", 0.0
    return got[0], "built", time.monotonic() - started


def _outcome_of(s, r) -> LayerOutcome:
    """The outcome of the planned layer ``s`` from its ``run_dag`` result ``r``."""
    if r.outcome == "done":
        record, status, seconds = r.value
        return LayerOutcome(s.name, s.kind, s.key, status, record, seconds)
    if r.outcome == "failed":
        err = r.error if isinstance(r.error, EnvbuildError) else None
        if err is None and r.error is not None and not isinstance(r.error, Exception):
            raise r.error  # KeyboardInterrupt and friends
        if err is None:
            raise r.error  # a bug: let the CLI boundary print the traceback
        return LayerOutcome(s.name, s.kind, s.key, "failed", error=err)
    return LayerOutcome(s.name, s.kind, s.key, "skipped", blocked_by=r.blocked_by)


def prepare_plan(ws: Snapshot, store: Store, targets: Iterable[str] | None, *,
                 no_cache: bool, cache_from: Store | None,
                 records: dict[str, KeyRecord] | None = None) -> BuildPlan:
    """The plan of ``targets`` against ``store``, after taking what ``cache_from`` has;
    ``records`` (if given) collects the key records the plan found."""
    plan = plan_with_store(ws, store, targets, records)
    if cache_from is not None and not no_cache:
        from envbuild.store.sync import pull_cached

        if pull_cached(cache_from, store, [s.key for s in plan.steps if s.status == "missing"]):
            plan = plan_with_store(ws, store, targets, records)
    return plan


def finish_build(ws: Snapshot, store: Store, plan: BuildPlan, outcomes: dict[str, LayerOutcome],
                 cache_to: Store | None) -> BuildReport:
    """Lock every env whose layers all have records, then every task whose env is locked and
    whose hidden layer has a record; push to ``cache_to``; the report."""
    lockable = [e.name for e in plan.envs
                if all(outcomes.get(n) and outcomes[n].record for n in e.layers)]
    published = publish_locks(ws, store, lockable)
    locks = [LockOutcome(e.name, published[e.name], f"env/{e.name}") if e.name in published
             else LockOutcome(e.name, None, f"env/{e.name}",
                              error="not locked: a layer failed or was skipped")
             for e in plan.envs]
    tasks = tuple(publish_task_locks(ws, store, published, [t.name for t in plan.tasks])
                  .values())
    ordered = tuple(outcomes[s.name] for s in plan.steps)
    # -- remote build cache, push side (S3 issue): layers + key records, then the lock refs ---
    if cache_to is not None:
        from envbuild.store.sync import sync

        sync(store, cache_to, refs=[*(lk.ref for lk in locks if lk.digest),
                                    *(t.ref for t in tasks if t.digest)],
             keys=[o.key for o in ordered if o.record is not None])
    # -----------------------------------------------------------------------------------------
    return BuildReport(layers=ordered, locks=tuple(locks), tasks=tasks)


def env_lock(ws: Snapshot, store: Store, env_name: str) -> Lock:
    """The lock of ``env_name`` from the key records in ``store`` (every layer must exist)."""
    env = ws.graph[env_name]
    if not isinstance(env, Env):
        raise BuildError(f"{env_name} is a {env.kind}, not an Env", hint="envbuild lock takes env names")
    layers: list[LockLayer] = []
    configs: list[RuntimeConfig] = []
    for n in ws.graph.env_layers(env_name):
        d = ws.graph.layer(n)
        key = ws.keys.layers[n]
        record = get_key_record(store, key)
        if record is None:
            raise BuildError(f"cannot lock {env_name}: layer {n} is not built",
                             hint=f"envbuild build {env_name}")
        imported = record.extra.get("config") if record.extra else None
        if imported:
            configs.append(RuntimeConfig(env=imported.get("env") or {},
                                         workdir=imported.get("workdir"),
                                         user=imported.get("user"),
                                         cmd=tuple(imported["cmd"]) if imported.get("cmd") else None))
        configs.append(_runtime_config(d.config))
        layers.append(LockLayer(name=n, role=ROLE_OF_KIND[d.kind], key=key, digest=record.layer,
                                diff_id=record.diff_id, size=record.size, toc_digest=record.toc))
    configs.append(_runtime_config(env.config))
    return make_lock(env_name, layers, merge_config(configs))


def publish_lock(ws: Snapshot, store: Store, env_name: str) -> str:
    """Store the env's lock and point ``env/<name>`` at it; return the manifest digest."""
    return publish_locks(ws, store, [env_name])[env_name]


def publish_locks(ws: Snapshot, store: Store, env_names: Iterable[str]) -> dict[str, str]:
    """Store each env's lock (config, then manifest), then move the ``env/<name>`` refs that
    changed in one ``put_refs``: a no-op build moves none, and a re-lock of 1,000 envs rewrites
    the local store's index.json once, not 1,000 times (benchmarks/build_noop.py)."""
    digests: dict[str, str] = {}
    for env_name in env_names:
        lock = env_lock(ws, store, env_name)
        config = put_json(store, lock.config, media_type=MEDIA_TYPE_CONFIG)
        if config.digest != lock.manifest["config"]["digest"]:
            raise bug(f"lock config of {env_name} stored as {config.digest}, "
                      f"manifest names {lock.manifest['config']['digest']}")
        digests[env_name] = put_json(store, lock.manifest, media_type=MEDIA_TYPE_MANIFEST).digest
    moved = {}
    for env_name, digest in digests.items():
        try:
            current = store.get_ref(f"env/{env_name}").digest
        except RefNotFound:
            current = None
        if current != digest:
            moved[f"env/{env_name}"] = digest
    store.put_refs(moved, media_type=MEDIA_TYPE_MANIFEST)
    return digests


def publish_task_lock(ws: Snapshot, store: Store, task_name: str) -> TaskOutcome:
    """Lock the task's env (as ``publish_lock``), then publish its task lock under
    ``task/<name>`` (its hidden layer must be built); the outcome, with the digests."""
    task = task_of(ws, task_name)
    key = ws.keys.tasks.get(task_name)
    if key is None or get_key_record(store, key) is None:  # before anything is written
        raise BuildError(f"cannot lock {task_name}: its hidden layer is not built",
                         hint=f"envbuild build {task_name}")
    env_digest = publish_lock(ws, store, task.env)
    outcome = publish_task_locks(ws, store, {task.env: env_digest}, [task_name])[task_name]
    if outcome.digest is None:
        raise BuildError(f"cannot lock {task_name}: {outcome.error}",
                         hint=f"envbuild build {task_name}")
    return outcome


def install_signal_cancel(ctx: BuildContext) -> None:
    """Turn SIGTERM into KeyboardInterrupt so builds clean up the same way as on Ctrl-C."""
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)
