"""REV's keys as a delta of the working tree's (``keys_from_delta``), for
``envbuild.build.gitrev``: only the definition files whose blob ids differ are read, checked,
pinned and keyed, with their dependents.

- The definition files of REV (``git ls-tree``) whose blob ids are those of the working
  tree's files at the same paths hold the same definitions (``ParseCache.tree_files``);
  only the others are read (the cache, else ``git cat-file``) and parsed.
- The graph checks run over what can have changed: the definitions of those files, and
  the definitions that refer to a name defined there or removed (an env also when one of
  its layers' base is); a cycle must pass through a changed base.
- A definition of an unchanged file keeps its pins when every path it reads has, at REV,
  the digest it has now (each path's digest at REV by git object id from the cache, else
  checked out and hashed, once per path); the others are pinned at REV as usual.
- Keys: ``compute_keys(previous=now)``, so only what changed and its dependents are keyed.

When this way cannot tell (a problem at REV, a Dockerfile base, many changed files) it says
so (None) and REV is loaded whole, which reports any problem exactly.
"""

from __future__ import annotations

import dataclasses
import os
from types import MappingProxyType

from envbuild.build.pin import Pinner, Snapshot, local_git_path, pin_inputs
from envbuild.build.revobjects import (
    input_paths,
    load_blobs,
    materialize,
    revision_files,
    sha256_input,
    wanted_paths,
)
from envbuild.defs.confine import Unpinnable
from envbuild.defs.model import (
    LAYER_KINDS,
    ArchiveSource,
    Base,
    BaseSource,
    BusyboxSource,
    DebootstrapSource,
    Definition,
    DefinitionSet,
    DockerfileSource,
    GitSource,
    ImageSource,
    PathSource,
    ScratchSource,
)
from envbuild.defs.parsecache import ParseCache
from envbuild.errors import EnvbuildError, Problem
from envbuild.plan.graph import EnvGraph, check_references
from envbuild.plan.keys import KeySet, PinnedInputs, Previous, compute_keys

#: ``keys_from_delta`` loads REV whole when more than this share of its files changed.
DELTA_MAX_SHARE = 0.2
#: Sources whose pins at REV follow from the digests of their paths (``input_paths``) alone;
#: a git source only with a remote URL (the same pinner resolves it the same way).
_DELTA_SOURCES = (type(None), ScratchSource, DebootstrapSource, BaseSource, ImageSource,
                  PathSource, ArchiveSource, BusyboxSource, GitSource)


class _NoDelta(Exception):
    """This way cannot tell: REV is loaded whole."""


@dataclasses.dataclass
class _Delta:
    """REV as the working tree changed: where it is read, and its definitions so far."""

    top: str
    rel: str
    commit: str
    tmp: str
    prefix: str  # how the loader names the files below the defs root ("" or "ROOT/")
    by_name: dict[str, Definition] = dataclasses.field(default_factory=dict)
    removed: set[str] = dataclasses.field(default_factory=set)  # now's names of changed files
    new_defs: list[Definition] = dataclasses.field(default_factory=list)  # read at REV
    preds: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def rev_file(self, path: str) -> str:
        """Where ``load_revision`` puts the file of REV at ``path`` (below the defs root)."""
        return os.path.join(self.tmp, self.rel, *path.split("/"))

    def placed(self, cache: ParseCache, d: Definition) -> Definition:
        """``d`` (a definition of now) with its origin in REV's copy of its file."""
        return cache.place(d, self.rev_file(d.origin.file[len(self.prefix):]))


def keys_from_delta(top: str, rel: str, commit: str, tmp: str, pinner: Pinner,
                    cache: ParseCache, now: Snapshot) -> KeySet | None:
    """REV's keys as the working tree's (``now``, loaded with ``cache``) changed where REV
    differs, without loading, checking or pinning REV whole; None when this way cannot tell
    (module docstring)."""
    try:
        delta = _load_changes(top, rel, commit, tmp, cache, now)
        _check_changes(delta, now)
        placed, pins = _pin_changes(delta, pinner, cache, now)
    except _NoDelta:
        return None
    return _keys(delta, now, cache, placed, pins)


def _load_changes(top: str, rel: str, commit: str, tmp: str, cache: ParseCache,
                  now: Snapshot) -> _Delta:
    """The definitions of REV: now's, those of the files whose blob ids differ read at REV."""
    listed = revision_files(top, rel, commit)
    if listed is None or any(k != "blob" or m not in ("100644", "100755")
                             for m, k, _, _ in listed):
        raise _NoDelta
    root = now.defs.root
    if root.endswith("/"):
        raise _NoDelta
    delta = _Delta(top, rel, commit, tmp, prefix="" if root == "." else root + "/")
    by_file: dict[str, list[str]] = {}
    for n, d in now.defs.by_name.items():
        by_file.setdefault(d.origin.file, []).append(n)
    now_oids: dict[str, str] = {}
    for f in by_file:
        oid = cache.tree_files.get(f)
        if oid is None or not f.startswith(delta.prefix):
            raise _NoDelta
        now_oids[f[len(delta.prefix):]] = oid
    rev_oids = {"/".join(parts): oid for _, _, oid, parts in listed}
    changed = sorted({p for p, o in rev_oids.items() if now_oids.get(p) != o}
                     | (now_oids.keys() - rev_oids.keys()))
    if len(changed) > max(64, DELTA_MAX_SHARE * len(rev_oids)):
        raise _NoDelta
    problems: list[Problem] = []
    files = [(delta.rev_file(p), "100644", "blob", rev_oids[p]) for p in changed if p in rev_oids]
    loaded = load_blobs(top, files, cache, problems, set())
    if problems:
        raise _NoDelta
    delta.removed = {n for p in changed if p in now_oids for n in by_file[delta.prefix + p]}
    delta.by_name = {n: d for n, d in now.defs.by_name.items() if n not in delta.removed}
    for f, *_ in files:
        for d in loaded[f]:
            if d.name in delta.by_name:
                raise _NoDelta  # a duplicate name: the whole load reports it
            delta.by_name[d.name] = d
            delta.new_defs.append(d)
    if any(isinstance(getattr(d, "source", None), DockerfileSource)
           for d in delta.by_name.values()):
        raise _NoDelta  # its FROM envs are read from the Dockerfile when the tree is loaded
    return delta


def _check_changes(delta: _Delta, now: Snapshot) -> None:
    """The graph checks of what can have changed; sets ``delta.preds``."""
    by_name, new_defs = delta.by_name, delta.new_defs
    names = delta.removed | {d.name for d in new_defs}
    succs = successors(now.graph)
    referrers = {m for n in names for m in succs.get(n, ()) if m not in names}
    layers = [n for n in referrers if by_name[n].kind in ("Workspace", "Toolkit")]
    referrers.update(m for n in layers for m in succs.get(n, ())
                     if m not in names and by_name[m].kind == "Env")
    preds = {n: p for n, p in now.graph.preds.items() if n not in delta.removed}
    check = [by_name[n] for n in sorted(referrers)] + new_defs
    for d in check:
        preds[d.name] = []
    if check_references(by_name, check, preds):
        raise _NoDelta
    for d in new_defs:
        seen: set[str] = set()
        n = d.name
        while True:
            b = by_name.get(n)
            if not isinstance(b, Base) or b.parent is None or n in seen:
                break
            seen.add(n)
            n = b.parent
            if n == d.name:
                raise _NoDelta  # a cycle
    delta.preds = preds


@dataclasses.dataclass
class _Reads:
    """What pinning REV reads in the repository: ``wanted``/``optional`` as
    ``revobjects.materialize`` takes them, and the paths unchanged definitions read, grouped
    by (directory now, directory at REV, path as written) -> the definitions reading it."""

    wanted: dict[str, bool] = dataclasses.field(default_factory=dict)
    optional: dict[str, bool] = dataclasses.field(default_factory=dict)
    groups: dict[tuple[str, str, str], list[str]] = dataclasses.field(default_factory=dict)
    group_rel: dict[tuple[str, str, str], str] = dataclasses.field(default_factory=dict)


def _pin_changes(delta: _Delta, pinner: Pinner, cache: ParseCache, now: Snapshot
                 ) -> tuple[dict[str, Definition], PinnedInputs]:
    """The definitions pinned again at REV (placed in REV's files) and their pins: the new
    ones and those whose paths' digests differ at REV; the others keep now's."""
    slow: dict[str, Definition] = {d.name: d for d in delta.new_defs
                                   if d.kind in LAYER_KINDS}
    reads = _group_reads(delta, pinner, now, slow)
    new_names = {d.name for d in delta.new_defs}  # placed at REV's files already
    placed = {n: d if n in new_names else delta.placed(cache, d) for n, d in slow.items()}
    wanted_paths(list(placed.values()), pinner, delta.tmp,  # type: ignore[arg-type]
                 reads.wanted, reads.optional)
    record = materialize(delta.top, delta.commit, delta.tmp, reads.wanted, pinner, cache,
                         reads.optional)
    for (now_dir, at_rev, path), users in reads.groups.items():
        try:
            same = pinner.path(now_dir, path) == pinner.path(at_rev, path)
        except Unpinnable:
            same = False  # pinned at REV as usual: that reports it
        if not same:
            for n in users:
                if n not in placed:
                    placed[n] = delta.placed(cache, now.defs.by_name[n])
    for d in placed.values():
        os.makedirs(pinner.directory_of(d.origin.file), exist_ok=True)
    display_root = os.path.normpath(os.path.join(delta.tmp, delta.rel))
    try:
        pins = pin_inputs(DefinitionSet(root=display_root, by_name=MappingProxyType(placed)),
                          pinner)
    except EnvbuildError:
        raise _NoDelta from None
    for key, path in record:
        digest = pinner.digest_of(path)
        if digest is not None:
            cache.note_pin(key, digest)
    return placed, pins


def _group_reads(delta: _Delta, pinner: Pinner, now: Snapshot,
                 slow: dict[str, Definition]) -> _Reads:
    """The paths now's unchanged layer definitions read (``_Reads``); a definition whose pins
    do not follow from its paths alone goes to ``slow`` (pinned at REV as a whole)."""
    reads = _Reads()
    rev_dirs: dict[str, str] = {}
    for n, d in now.defs.by_name.items():
        if n in delta.removed or d.kind not in LAYER_KINDS:
            continue
        src = getattr(d, "source", None)
        now_dir = pinner.directory_of(d.origin.file)
        if not isinstance(src, _DELTA_SOURCES) or (
                isinstance(src, GitSource) and local_git_path(src.url, now_dir) is not None):
            slow[n] = d
            continue
        paths = input_paths(d)  # type: ignore[arg-type]
        if not paths:
            continue
        at_rev = rev_dirs.get(now_dir)
        if at_rev is None:
            at_rev = rev_dirs[now_dir] = pinner.directory_of(
                delta.rev_file(d.origin.file[len(delta.prefix):]))
        for path, through_path in paths:
            group = (now_dir, at_rev, path)
            users = reads.groups.get(group)
            if users is None:
                rel_path = (None if os.path.isabs(path) else os.path.relpath(
                    os.path.normpath(os.path.join(at_rev, path)), delta.tmp))
                if rel_path is None or rel_path == "." or rel_path.startswith(".."):
                    slow[n] = d
                    break
                users = reads.groups[group] = []
                reads.group_rel[group] = rel_path
                reads.wanted[rel_path] = reads.wanted.get(rel_path, True) and through_path
            users.append(n)
            rp = reads.group_rel[group]
            reads.optional[rp] = reads.optional.get(rp, True) and path == sha256_input(d)
    return reads


def _keys(delta: _Delta, now: Snapshot, cache: ParseCache, placed: dict[str, Definition],
          pins: PinnedInputs) -> KeySet:
    """REV's keys: what can have another key (the changed and re-pinned definitions and
    their dependents at REV) keyed again, the others are now's definitions, pins and
    upstreams, so now's keys."""
    pinned = dict(now.pinned)
    for n in delta.removed | placed.keys():
        pinned.pop(n, None)
    pinned.update(pins)
    by_name = {**delta.by_name, **placed}
    display_root = os.path.normpath(os.path.join(delta.tmp, delta.rel))
    graph = EnvGraph(defs=DefinitionSet(root=display_root, by_name=MappingProxyType(by_name)),
                     preds=delta.preds)
    # a name of a changed file is new even if it was there
    dirty = {d.name for d in delta.new_defs} | placed.keys()
    new_succs: dict[str, list[str]] = {}
    for d in delta.new_defs:
        for dep in delta.preds[d.name]:
            new_succs.setdefault(dep, []).append(d.name)
    succs = successors(now.graph)
    todo = list(dirty)
    while todo:
        n = todo.pop()
        for m in (*succs.get(n, ()), *new_succs.get(n, ())):
            if m not in dirty and m in by_name:
                dirty.add(m)
                todo.append(m)
    original = cache.original
    previous = Previous(graph=now.graph, pinned=now.pinned, keys=now.keys,
                        same=lambda a, b: a is b or original(a) is original(b))
    return compute_keys(graph, MappingProxyType(pinned), previous, cache, only=dirty)


def successors(graph: EnvGraph) -> dict[str, list[str]]:
    """Name -> the names that depend on it directly, once per graph."""
    succs = graph._memo.get("succs")
    if succs is None:
        succs = graph._memo["succs"] = {}
        for n, deps in graph.preds.items():
            for dep in deps:
                succs.setdefault(dep, []).append(n)
    return succs
