"""The definition tree as it was at a git revision, without touching the working tree.

``envbuild plan --changed-since REV`` and ``envbuild explain --against REV`` compare keys at REV
with keys now. REV is never checked out in full (at 100,000 definitions that alone cost more
than the whole goal). Given the working tree's snapshot and the parse cache it was loaded
with, REV is first taken as a delta of the working tree (``envbuild.build.revdelta``: only the
files whose blob ids differ are read, checked, pinned and keyed, with their dependents); what
the delta cannot tell is done by loading REV whole from git objects (``_keys_from_objects``,
with ``envbuild.build.revobjects``):

- the definition files are listed with ``git ls-tree -r -z REV -- DEFS`` (blob ids and names
  inside the tree, never a path followed on disk); a blob id the parse cache knows (every file
  it hashed, from either tree) is not read at all; the others are read through one ``git
  cat-file --batch`` process, a blob over the file size limit read past and reported as one
  problem, as a file is; a symlink or submodule where a definition file would be is a problem
  at REV (it is not followed);
- the parsed definitions get origins in a temporary directory laid out like a checkout, and of
  the rest of the repository only what pinning reads (path and copy sources, archives, …) is
  checked out there, with ``git checkout-index`` from a temporary index (``GIT_INDEX_FILE``):
  files get the modes a fresh clone would get under the current umask and smudge/eol filters
  apply, so an unchanged source hashes the same as in the working tree. (``git archive`` writes
  modes with its own ``tar.umask``, 0664, which would make every path source look changed.)
- revs reach git only after ``--end-of-options``; later calls get the commit id it named;
- a file the YAML pins by sha256 (an ``archive``, a ``rootfs`` tarball) that git does not have
  at REV (too big to commit, ignored) is read from the working tree at the same place
  (``Pinner.read_missing_from``): the sha256 pins its content; one that does not match is an
  error saying so.

The repository's own index, working tree and ``.git/worktrees`` are never touched.
``keys_at_revision_checkout`` is the old full-checkout way, kept as the reference the tests
compare the fast path with.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

from envbuild.build.pin import Pinner, Snapshot, snapshot, snapshot_graph
from envbuild.build.revdelta import DELTA_MAX_SHARE  # noqa: F401  (re-exported)
from envbuild.build.revdelta import keys_from_delta as _keys_from_delta
from envbuild.build.revobjects import (  # noqa: F401  (checkout, load_revision: re-exported)
    NeedCheckout,
    checkout,
    load_revision,
    materialize_inputs,
    revision,
)
from envbuild.defs.model import Task
from envbuild.defs.parsecache import ParseCache
from envbuild.errors import EnvbuildError, PlanError, Problem, SourceError
from envbuild.plan.changes import Changes, Explanation, diff_keys, explain
from envbuild.plan.graph import check_loaded, did_you_mean
from envbuild.plan.keys import KeySet, Previous
from envbuild.plan.planner import BuildPlan, Lookup, make_plan
from envbuild.plan.taskplan import hidden_key_inputs


def keys_at_revision(defs_dir: Path, rev: str, pinner: Pinner | None = None,
                     parse_cache: ParseCache | None = None,
                     now: Snapshot | None = None) -> KeySet:
    """Every key of ``defs_dir`` as it was at git revision ``rev``, without a checkout: the
    definition files are listed with ``git ls-tree`` and only blobs ``parse_cache`` has not
    seen are read (``load_revision``); of the rest of the repository only what pinning reads
    is checked out (``materialize_inputs``).

    With ``now`` (the working tree's snapshot, loaded with the same ``parse_cache``), a
    definition whose file content, pins and upstreams are the same as now keeps its key from
    ``now`` instead of being keyed again.

    A defs dir that did not exist at ``rev`` has no keys: everything is new.
    """
    top, rel, commit = revision(defs_dir, rev)
    try:
        if now is not None and parse_cache is not None:
            with tempfile.TemporaryDirectory(prefix="envbuild-rev-") as tmp:
                root = os.path.join(tmp, "tree")
                os.mkdir(root)
                pinner = pinner or Pinner()
                pinner.read_missing_from(root, top)
                keys = _keys_from_delta(top, rel, commit, root, pinner, parse_cache, now)
            if keys is not None:
                return keys
        return _keys_from_objects(defs_dir, rev, top, rel, commit, pinner, parse_cache, now)
    except NeedCheckout:
        return keys_at_revision_checkout(defs_dir, rev, pinner)


def _keys_from_objects(defs_dir: Path, rev: str, top: str, rel: str, commit: str,
                       pinner: Pinner | None, parse_cache: ParseCache | None,
                       now: Snapshot | None) -> KeySet:
    with tempfile.TemporaryDirectory(prefix="envbuild-rev-") as tmp:
        root = os.path.join(tmp, "tree")
        os.mkdir(root)
        try:
            loaded = load_revision(top, rel, commit, root, parse_cache)
            if loaded is None:
                empty: MappingProxyType = MappingProxyType({})
                return KeySet(layers=empty, inputs=empty, env_locks=empty, env_inputs=empty)
            graph = check_loaded(loaded)
            pinner = pinner or Pinner()
            pinner.read_missing_from(root, top)
            record = materialize_inputs(top, commit, root, graph.defs, pinner, parse_cache)
            previous = None
            if now is not None and parse_cache is not None:
                original = parse_cache.original
                previous = Previous(graph=now.graph, pinned=now.pinned, keys=now.keys,
                                    same=lambda a, b: original(a) is original(b))
            keys = snapshot_graph(graph, pinner, previous, parse_cache).keys
            if parse_cache is not None:
                for key, path in record:
                    digest = pinner.digest_of(path)
                    if digest is not None:
                        parse_cache.note_pin(key, digest)
            return keys
        except EnvbuildError as e:
            # Report against the revision, not the temporary directory it was read into.
            lines = [ln.replace(f"{root}{os.sep}", f"{rev}:") for ln in e.render_lines()]
            raise SourceError(f"the definitions at {rev} cannot be keyed",
                              context="\n".join(lines),
                              hint="compare against a revision whose definitions are valid") from e


def keys_at_revision_checkout(defs_dir: Path, rev: str, pinner: Pinner | None = None) -> KeySet:
    """``keys_at_revision`` the slow way, from a full checkout of ``rev`` (the reference)."""
    with checkout(defs_dir, rev) as (root, then):
        if not then.is_dir():
            empty: MappingProxyType = MappingProxyType({})
            return KeySet(layers=empty, inputs=empty, env_locks=empty, env_inputs=empty)
        pinner = pinner or Pinner()
        pinner.read_missing_from(str(root), revision(defs_dir, rev)[0])
        try:
            return snapshot(then, pinner).keys
        except EnvbuildError as e:
            lines = [ln.replace(f"{root}{os.sep}", f"{rev}:") for ln in e.render_lines()]
            raise SourceError(f"the definitions at {rev} cannot be keyed",
                              context="\n".join(lines),
                              hint="compare against a revision whose definitions are valid") from e


# ---------------------------------------------------------------------- what the CLI calls


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """The cyclic garbage collector off while two trees are loaded: they are millions of
    long-lived objects and no cyclic garbage, and every full collection walks all of them for
    nothing (measured: about half of ``plan --changed-since`` at 10,000 definitions).

    Turned on again, the collector's next young collection would walk every object made
    meanwhile (a second at 100,000 definitions): they are moved to the oldest generation
    first (``gc.freeze``/``gc.unfreeze``), which only a full collection walks, as it would
    once they had survived the young ones."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.freeze()
            gc.enable()
            gc.unfreeze()


def plan_changes(defs_dir: Path, targets: list[str] | None, rev: str | None,
                 lookup: Lookup | None = None, pinner: Pinner | None = None,
                 parse_cache: ParseCache | None = None) -> tuple[BuildPlan, Changes | None]:
    """Plan ``targets`` of ``defs_dir`` now and, given ``rev``, what changed since then.

    With targets, the changes are limited to the planned layers and envs. ``parse_cache``:
    only files it does not know are parsed, in either tree (the two share all but the
    changed files), and it is saved at the end (``envbuild.defs.parsecache``).
    """
    pinner = pinner or Pinner()
    with _no_cyclic_gc():
        now = snapshot(defs_dir, pinner, parse_cache)
        plan = make_plan(now.graph, now.pinned, lookup, targets, keys=now.keys)
        if rev is None:
            if parse_cache is not None:
                parse_cache.save()
            return plan, None
        changes = diff_keys(keys_at_revision(defs_dir, rev, pinner, parse_cache, now), now.keys)
        if parse_cache is not None:
            parse_cache.save()
    if targets is not None:
        layers = {s.name for s in plan.layers}
        envs = {e.name for e in plan.envs}
        changes = Changes(rebuild=tuple(n for n in changes.rebuild if n in layers),
                          relock=tuple(n for n in changes.relock if n in envs))
    return plan, changes


def explain_at(defs_dir: Path, name: str, rev: str | None = None) -> Explanation:
    """Explain ``name`` (a definition name, or a layer key) now and, given ``rev``, since then."""
    pinner = Pinner()
    now = snapshot(defs_dir, pinner)
    by_name = now.defs.by_name
    if name not in by_name and name.startswith("sha256:"):
        named = sorted(n for n, k in now.keys.layers.items() if k.startswith(name))
        name = named[0] if named else name
    if name not in by_name:
        raise PlanError(Problem("<command line>", 0, 0, f"no definition or key {name!r}",
                                hint=did_you_mean(name, by_name)))
    task = by_name[name]
    if isinstance(task, Task):  # its hidden layer's key (envbuild.plan.taskplan)
        if rev is not None:
            raise PlanError(Problem("<command line>", 0, 0, f"{name!r} is a Task: its hidden "
                                    "layer's key is not compared across revisions",
                                    hint=f"explain it without --against, or its env: "
                                         f"{task.env}"))
        lowers = [now.keys.layers[n] for n in now.graph.env_layers(task.env)]
        return Explanation(name=name, kind="Task", digest=now.keys.tasks[name],
                           inputs=hidden_key_inputs(task, now.pinned[name], lowers))
    old = keys_at_revision(defs_dir, rev, pinner) if rev is not None else None
    return explain(name, by_name[name].kind, now.keys, old)
