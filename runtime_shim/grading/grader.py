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
5. records the verdict in the store (provenance: task lock, source, change set, grading
   lock) and returns it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from envbuild.errors import RuntimeShimError, SandboxNotFound
from envbuild.layers import LayerReader
from envbuild.store import Store, put_file, put_json
from runtime_shim.backends.base import Snapshottable
from runtime_shim.grading.changes import ChangeLimits, ChangeRules, Dropped, change_filter
from runtime_shim.grading.verdict import MEDIA_TYPE_VERDICT, OUTPUT_TAIL_BYTES, Verdict, decide
from runtime_shim.node import packdiff
from runtime_shim.node.layout import NodeLayout
from runtime_shim.node.locks import ResolvedLock, resolve
from runtime_shim.node.model import Limits
from runtime_shim.node.records import StoreLike, node_layout, open_store, read_record
from runtime_shim.node.tasklock import TaskLock, load_task
from runtime_shim.sdk.sandbox import Sandbox

#: the change set's name in the grading lock's history
CHANGES_NAME = "changes"


def grade(task: str, source: str, *, store: StoreLike | None = None,
          node_dir: str | os.PathLike[str] | NodeLayout | None = None,
          limits: Limits | None = None, change_limits: ChangeLimits | None = None,
          record: bool = True) -> Verdict:
    """Grade ``source`` (a sandbox id on this node, or a snapshot's ref or lock digest) on
    ``task`` (``task/NAME``, a bare task name or a task lock digest); see the module
    docstring. ``limits``: the grading sandbox's (default ``Limits()``). Errors:
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
        stored = put_json(opened, verdict.to_json(), media_type=MEDIA_TYPE_VERDICT)
        verdict = _with_record(verdict, stored.digest)
    return verdict


def _with_record(verdict: Verdict, digest: str) -> Verdict:
    import dataclasses

    return dataclasses.replace(verdict, record=digest)


def _hidden_files(store: Store, tl: TaskLock) -> list[str]:
    with LayerReader.from_store(store, tl.hidden.digest,
                                expected_toc_digest=tl.hidden.toc_digest) as reader:
        return [e.path for e in reader.entries() if e.type != "dir"]


# ------------------------------------------------------------------------ the change set


def _is_sandbox(layout: NodeLayout, source: str) -> bool:
    if "/" in source or source.startswith("sha256:") or source in (".", ".."):
        return False
    return read_record(layout.sandbox(source)) is not None


def _change_set(store: Store, layout: NodeLayout, env: ResolvedLock, source: str,
                rules: ChangeRules, dropped: Dropped) -> tuple[dict[str, Any], str]:
    """The filtered change set of ``source`` packed and stored: ``(layer descriptor, what
    was read)``; the label is the sandbox id or the snapshot lock's digest."""
    with _scratch(layout) as work:
        blob = work / "changes.tar.zst"
        if not _is_sandbox(layout, source):
            digest = resolve(store, source).digest
            return _from_snapshot(store, env, digest, rules, dropped, work, blob), digest
        sb = Sandbox.attach(source, store=store, node_dir=layout)   # the agent's: not closed
        if sb.lock.digest == env.digest:
            return _store_layer(store, blob, _pack_live(sb, rules, dropped, blob)), source
        # a sandbox of a snapshot or checkpoint: its lock's own layers are changes too
        snapshot = sb.pack_diff(None).lock
        return (_from_snapshot(store, env, snapshot, rules, dropped, work, blob),
                f"{source} (snapshot {snapshot})")


def _pack_live(sb: Sandbox, rules: ChangeRules, dropped: Dropped, blob: Path):
    handle = sb.handle
    if not isinstance(handle, Snapshottable):
        raise RuntimeShimError(f"sandbox {sb.id}: the {sb.backend} backend cannot show its "
                               "changes", hint="grade a snapshot of it (pack_diff) instead")
    with handle.quiesce(), open(blob, "wb") as out:
        info, _report = packdiff.pack_upper(
            handle.upper_dir(), out, packdiff.SnapshotPolicy(), name=f"the changes of {sb.id}",
            select=change_filter(rules, dropped))
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
        info, _report = packdiff.pack_upper(upper, out, packdiff.SnapshotPolicy(),
                                            name=f"the changes of {source}",
                                            select=change_filter(rules, dropped))
    return _store_layer(store, blob, info)


def _store_layer(store: Store, blob: Path, info) -> dict[str, Any]:
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
                        limits=limits) as sb:
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
