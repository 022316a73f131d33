"""Trusted grading: a task's grade command run on an agent's filtered changes, in a fresh
sandbox of the task's own env lock plus its hidden layer (issue 35).

``grade(task, source)``:

1. reads the task lock (``runtime_shim.node.tasklock``) and the hidden layer's file list;
2. reads the agent's changes — from a live sandbox on this node (its upper dir, processes
   frozen meanwhile; a sandbox of a snapshot is first packed with pack-diff), or from a
   snapshot lock (its snapshot layers merged) — and packs the ones the change-set filter keeps
   (``runtime_shim.grading.changes``) into one layer, the **change set**, stored by digest;
3. starts a fresh sandbox of the env lock + the change set + the hidden layer on top (no
   network, the default limits): nothing the agent wrote outside its editable paths exists
   there, so ``/bin/sh``, the interpreter and the test runner are the env's;
4. runs the grade command (``/bin/sh -c RUN`` in ``workdir``, its timeout, env and user),
   reads the JUnit report the task names, closes the sandbox, and decides
   (``runtime_shim.grading.verdict``);
5. records the verdict in the store — an OCI artifact under ``verdict/TASK/ID`` whose config
   is the verdict (provenance: task lock, source, change set, grading lock) and whose layer is
   the change set it graded — and returns it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from envbuild.errors import RuntimeShimError, SandboxNotFound
from envbuild.layers import LayerInfo, LayerReader
from envbuild.oci import ANNOTATION_NAME, ANNOTATION_TOC, MEDIA_TYPE_LAYER_ZSTD, MEDIA_TYPE_MANIFEST
from envbuild.store import Store, put_file, put_json
from runtime_shim.backends.base import Snapshottable
from runtime_shim.grading.changes import ChangeLimits, ChangeRules, Dropped, change_filter
from runtime_shim.grading.verdict import (
    ANNOTATION_TASK_LOCK,
    MEDIA_TYPE_VERDICT,
    OUTPUT_TAIL_BYTES,
    VERDICT_ARTIFACT_TYPE,
    VERDICT_REF_PREFIX,
    Verdict,
    decide,
)
from runtime_shim.node import packdiff
from runtime_shim.node.layout import NodeLayout
from runtime_shim.node.locks import ResolvedLock, resolve
from runtime_shim.node.model import Limits
from runtime_shim.node.records import StoreLike, node_layout, open_store, read_record
from runtime_shim.node.tasklock import TaskLock, load_task
from runtime_shim.sdk.sandbox import Sandbox

#: the change set's name in the grading lock's history
CHANGES_NAME = "changes"
#: the grading sandbox's limits unless the caller gives others: the defaults, with a smaller
#: disk (a test run writes little; the node's disk budget reserves each sandbox's full disk,
#: so 10 GiB each would cap a trainer's concurrent grades at a few per node)
GRADE_LIMITS = Limits(disk_bytes=2 << 30)


def grade(task: str, source: str | Sandbox, *, store: StoreLike | None = None,
          node_dir: str | os.PathLike[str] | NodeLayout | None = None,
          limits: Limits | None = None, change_limits: ChangeLimits | None = None,
          record: bool = True) -> Verdict:
    """Grade ``source`` (a ``Sandbox``, a sandbox id on this node, or a snapshot's ref or
    lock digest) on
    ``task`` (``task/NAME``, a bare task name or a task lock digest); see the module
    docstring. ``limits``: the grading sandbox's (default ``GRADE_LIMITS``). Errors:
    ``LockNotFound`` (no such task or snapshot), ``RuntimeShimError`` (a source that is not of
    the task's env, a change set the store refused), ``AdmissionRefused``,
    ``SandboxStartError``; the grade command failing is a verdict, not an error."""
    started = time.monotonic()
    opened = open_store(store)
    layout = node_layout(node_dir).ensure()
    tl = load_task(opened, task)
    env = resolve(opened, tl.spec.env_lock)
    rules = ChangeRules.of(tl.spec, _hidden_files(opened, tl), change_limits)
    dropped = Dropped()
    layer, label = _change_set(opened, layout, env, source, rules, dropped)
    grading_lock = _grading_lock(opened, env, tl, layer)
    read = time.monotonic()
    exit_code, timed_out, output, report, made = _run(opened, layout, grading_lock, tl, limits)
    ran = time.monotonic()
    passed, tests, reason = decide(exit_code, timed_out,
                                   (*tl.spec.must_pass, *tl.spec.keep_passing), report)
    verdict = Verdict(passed=passed, exit_code=exit_code, timed_out=timed_out, output=output,
                      tests=tests, change_set=layer["digest"], dropped=dropped.listed,
                      dropped_more=dropped.more, task=tl.digest, source=label,
                      grading_lock=grading_lock, reason=reason,
                      seconds={"changes": read - started, "create": made - read,
                               "run": ran - made, "total": time.monotonic() - started})
    if record:
        verdict = dataclasses.replace(verdict, record=_record(opened, verdict, tl, layer))
    return verdict


def _record(store: Store, verdict: Verdict, tl: TaskLock, changes: dict[str, Any]) -> str:
    """Store ``verdict`` as an OCI artifact (config: the verdict's JSON; layer: the change set
    it graded; annotated with the task lock) under ``verdict/TASK/ID``, so that ``gc`` keeps
    the verdict with what it graded and ``push`` copies both; the manifest's digest."""
    config = put_json(store, verdict.to_json(), media_type=MEDIA_TYPE_VERDICT)
    manifest = {"schemaVersion": 2, "mediaType": MEDIA_TYPE_MANIFEST,
                "artifactType": VERDICT_ARTIFACT_TYPE,
                "config": {"mediaType": MEDIA_TYPE_VERDICT, "digest": config.digest,
                           "size": config.size},
                "layers": [{"mediaType": MEDIA_TYPE_LAYER_ZSTD, "digest": changes["digest"],
                            "size": changes["size"],
                            "annotations": {ANNOTATION_TOC: changes["toc_digest"]}}],
                "annotations": {ANNOTATION_TASK_LOCK: tl.digest,
                                ANNOTATION_NAME: tl.spec.name}}
    digest = put_json(store, manifest, media_type=MEDIA_TYPE_MANIFEST).digest
    store.put_ref(f"{VERDICT_REF_PREFIX}{tl.spec.name}/{config.digest[7:31]}", digest,
                  media_type=MEDIA_TYPE_MANIFEST)
    return digest


def _hidden_files(store: Store, tl: TaskLock) -> list[str]:
    with LayerReader.from_store(store, tl.hidden.digest,
                                expected_toc_digest=tl.hidden.toc_digest) as reader:
        return [e.path for e in reader.entries() if e.type != "dir"]


# ------------------------------------------------------------------------ the change set


def _is_sandbox(layout: NodeLayout, source: str) -> bool:
    if "/" in source or source.startswith("sha256:") or source in (".", ".."):
        return False
    return read_record(layout.sandbox(source)) is not None


def _change_set(store: Store, layout: NodeLayout, env: ResolvedLock, source: str | Sandbox,
                rules: ChangeRules, dropped: Dropped) -> tuple[dict[str, Any], str]:
    """The filtered change set of ``source`` packed and stored: ``(layer descriptor, what
    was read)``; the label is the sandbox id or the snapshot lock's digest."""
    with _scratch(layout) as work:
        blob = work / "changes.tar.zst"
        if isinstance(source, Sandbox):
            sb = source
        elif _is_sandbox(layout, source):
            sb = Sandbox.attach(source, store=store, node_dir=layout)   # the agent's: not closed
        else:
            digest = resolve(store, source).digest
            return _from_snapshot(store, env, digest, rules, dropped, work, blob), digest
        if sb.lock.digest == env.digest:
            return _store_layer(store, blob, _pack_live(sb, rules, dropped, blob)), sb.id
        # a sandbox of a snapshot or checkpoint: its lock's own layers are changes too
        snapshot = sb.pack_diff(None).lock
        return (_from_snapshot(store, env, snapshot, rules, dropped, work, blob),
                f"{sb.id} (snapshot {snapshot})")


def _pack_live(sb: Sandbox, rules: ChangeRules, dropped: Dropped, blob: Path) -> LayerInfo:
    handle = sb.handle
    if not isinstance(handle, Snapshottable):
        raise RuntimeShimError(f"sandbox {sb.id}: the {sb.backend} backend cannot show its "
                               "changes", hint="grade a snapshot of it (pack_diff) instead")
    with handle.quiesce(), open(blob, "wb") as out:
        info, report = packdiff.pack_upper(
            handle.upper_dir(), out, packdiff.SnapshotPolicy(), name=f"the changes of {sb.id}",
            select=change_filter(rules, dropped))
    dropped.add_policy(report.decisions)
    return info


def _from_snapshot(store: Store, env: ResolvedLock, source: str, rules: ChangeRules,
                   dropped: Dropped, work: Path, blob: Path) -> dict[str, Any]:
    lock = resolve(store, source)
    base = [layer.digest for layer in env.layers]
    if [layer.digest for layer in lock.layers[:len(base)]] != base:
        raise RuntimeShimError(f"{source} is not a snapshot of the task's env lock "
                               f"{env.digest}", hint="grade a sandbox or snapshot made from "
                                                     "the task (Sandbox.create('task/NAME'))")
    upper = work / "upper"
    upper.mkdir()
    packdiff.merge_upper(store, lock.layers[len(base):], upper)
    with open(blob, "wb") as out:
        info, report = packdiff.pack_upper(upper, out, packdiff.SnapshotPolicy(),
                                           name=f"the changes of {source}",
                                           select=change_filter(rules, dropped))
    dropped.add_policy(report.decisions)
    return _store_layer(store, blob, info)


def _store_layer(store: Store, blob: Path, info: LayerInfo) -> dict[str, Any]:
    stored = put_file(store, blob)
    if stored.digest != info.digest:
        raise RuntimeShimError(f"change set stored as {stored.digest}, packed {info.digest}")
    return {"digest": info.digest, "size": info.size, "diff_id": info.diff_id,
            "toc_digest": info.toc_digest, "name": CHANGES_NAME}


@contextlib.contextmanager
def _scratch(layout: NodeLayout) -> Iterator[Path]:
    layout.grades.mkdir(mode=0o700, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"grade-{uuid.uuid4().hex[:8]}-", dir=layout.grades))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _grading_lock(store: Store, env: ResolvedLock, tl: TaskLock, changes: dict[str, Any]) -> str:
    hidden = {**tl.hidden.to_json(), "name": f"{tl.spec.name}.hidden"}
    manifest, config = packdiff.derive_lock(env, [changes, hidden], keep=len(env.layers),
                                            created="1970-01-01T00:00:00Z")
    return packdiff.publish_lock(store, manifest, config, None)


# ---------------------------------------------------------------------------- the run


def _run(store: Store, layout: NodeLayout, grading_lock: str, tl: TaskLock,
         limits: Limits | None) -> tuple[int | None, bool, str, bytes | None, float]:
    """Create the grading sandbox, run the grade command, read its report, close it:
    ``(exit code, timed out, output tail, report or None, when the sandbox was made)``."""
    spec = tl.spec
    with Sandbox.create(grading_lock, store=store, node_dir=layout, network=False,
                        limits=limits or GRADE_LIMITS) as sb:
        made = time.monotonic()
        if spec.junit:  # a fresh, empty dir for the report, made by root
            sb.exec(["/bin/sh", "-c", 'rm -rf -- "$1" && mkdir -p -- "$1" && chmod 1777 "$1"',
                     "sh", os.path.dirname(spec.junit)], user="0:0", timeout=30)
        result = sb.exec(["/bin/sh", "-c", spec.run], cwd=spec.workdir, timeout=spec.timeout,
                         env=dict(spec.env) or None, user=spec.user)
        output = (result.stdout + result.stderr)[-OUTPUT_TAIL_BYTES:]
        report = None
        if spec.junit:
            with contextlib.suppress(RuntimeShimError, SandboxNotFound):
                report = sb.read_file(spec.junit)
    return (None if result.timed_out else result.exit_code, result.timed_out,
            output.decode("utf-8", "replace"), report, made)
