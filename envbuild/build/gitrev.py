"""The definition tree as it was at a git revision, without touching the working tree.

``envbuild plan --changed-since REV`` and ``envbuild explain --against REV`` compare keys at REV
with keys now. REV is never checked out in full (at 100,000 definitions that alone cost more
than the whole goal). Given the working tree's snapshot and the parse cache it was loaded
with, REV is first taken as a delta of the working tree (``_keys_from_delta``: only the files
whose blob ids differ are read, checked, pinned and keyed, with their dependents); what the
delta cannot tell is done by loading REV whole from git objects (``_keys_from_objects``):

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
- revs reach git only after ``--end-of-options``; later calls get the commit id it named.

The repository's own index, working tree and ``.git/worktrees`` are never touched.
``keys_at_revision_checkout`` is the old full-checkout way, kept as the reference the tests
compare the fast path with.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

from envbuild.build.pin import (
    Pinner,
    Snapshot,
    git_env,
    local_git_path,
    pin_inputs,
    snapshot,
    snapshot_graph,
)
from envbuild.defs.confine import Unpinnable
from envbuild.defs.load import (
    MAX_YAML_BYTES,
    SEPARATE_TREE_MARKER,
    SUFFIXES,
    LoadResult,
    assemble,
    load_bytes,
)
from envbuild.defs.model import (
    ArchiveSource,
    Base,
    BaseSource,
    BusyboxSource,
    CopyStep,
    DebootstrapSource,
    Definition,
    DefinitionSet,
    DockerfileSource,
    GitSource,
    ImageSource,
    LayerDefinition,
    OciSource,
    PathSource,
    RootfsSource,
    ScratchSource,
)
from envbuild.defs.parsecache import ParseCache
from envbuild.errors import DefinitionError, EnvbuildError, PlanError, Problem, SourceError
from envbuild.plan.changes import Changes, Explanation, diff_keys, explain
from envbuild.plan.graph import EnvGraph, check_loaded, check_references, did_you_mean
from envbuild.plan.keys import KeySet, Previous, compute_keys
from envbuild.plan.planner import BuildPlan, Lookup, make_plan


def _git(argv: list[str], cwd: str, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True,
                              env={**git_env(), **(env or {})}, check=False)
    except FileNotFoundError:
        raise SourceError("git is not installed", hint="apt-get install git") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise SourceError(f"git {argv[0]} exited {done.returncode}", context=tail)
    return done.stdout


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.is_dir():
        path = path.parent
    return path


def _revision(path: Path, rev: str) -> tuple[str, str, str]:
    """(top of the work tree holding ``path``, ``path`` relative to it, the commit id ``rev``
    names). ``rev`` is given to git only after ``--end-of-options``; later calls get the id."""
    here = _existing_ancestor(path)
    try:
        top = _git(["rev-parse", "--show-toplevel"], str(here)).strip()
    except SourceError as e:
        raise SourceError(f"{path} is not inside a git repository",
                          hint="--changed-since/--against need the definitions in git") from e
    rel = os.path.relpath(os.path.realpath(path.absolute()), os.path.realpath(top))
    try:
        commit = _git(["rev-parse", "--verify", "--quiet", "--end-of-options",
                       f"{rev}^{{commit}}"], top).strip()
    except SourceError:
        raise SourceError(f"unknown git revision {rev!r}",
                          hint="give a commit, branch or tag, e.g. HEAD~1 or origin/main") from None
    if not _OID_RE.fullmatch(commit):
        raise SourceError(f"git rev-parse {rev!r} printed {commit[:80]!r}, not a commit id")
    return top, rel, commit


@contextlib.contextmanager
def checkout(path: Path, rev: str) -> Iterator[tuple[Path, Path]]:
    """Yield (root of a temporary checkout of ``rev``, where ``path`` is inside it).

    ``path`` must be inside a git work tree; where it is at ``rev`` may not exist. The whole
    repository is checked out: ``keys_at_revision`` does not need this (it reads git objects),
    it is the reference the fast path is tested against.
    """
    top, rel, commit = _revision(path, rev)
    with tempfile.TemporaryDirectory(prefix="envbuild-rev-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        tree = os.path.join(tmp, "tree")
        _git(["read-tree", "--end-of-options", commit], top, env)
        _git(["checkout-index", "--all", "--force", f"--prefix={tree}/"], top, env)
        yield Path(tree), Path(tree) / rel


_OID_RE = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_LITERAL = {"GIT_LITERAL_PATHSPECS": "1"}  # a path is a name, never a pathspec pattern


def _ls_tree(top: str, commit: str, paths: list[str], recursive: bool = True
             ) -> list[tuple[str, str, str, str]]:
    """(mode, type, oid, path) of the entries of ``commit`` under ``paths`` (repo-relative;
    ``[]`` = all), from ``git ls-tree -z``: names inside the tree, never a file on disk."""
    argv = ["ls-tree", "-z", "--full-tree", *(["-r"] if recursive else []),
            "--end-of-options", commit, "--", *paths]
    out = []
    for record in _git(argv, top, _LITERAL).split("\0"):
        if record:
            meta, _, name = record.partition("\t")
            mode, kind, oid = meta.split(" ")
            out.append((mode, kind, oid, name))
    return out


def _read_blobs(top: str, oids: list[str], limit: int) -> dict[str, bytes | int]:
    """The bytes of each blob, from one ``git cat-file --batch``; a blob over ``limit`` bytes
    is read past (never held) and given as its size."""
    try:
        proc = subprocess.Popen(["git", "cat-file", "--batch"], cwd=top, env=git_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SourceError("git is not installed", hint="apt-get install git") from None
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def feed() -> None:  # a thread: git's output pipe must be drained while we write
        try:
            stdin.write("".join(f"{o}\n" for o in oids).encode())
            stdin.close()
        except OSError:
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    out: dict[str, bytes | int] = {}
    try:
        for oid in oids:
            header = stdout.readline(200).split()
            if len(header) != 3 or header[1] != b"blob" or not header[2].isdigit():
                raise SourceError(f"git cat-file: no blob {oid}",
                                  context=b" ".join(header).decode(errors="replace"))
            size = int(header[2])
            if size > limit:
                left = size
                while left:
                    chunk = stdout.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    left -= len(chunk)
                out[oid] = size
            else:
                out[oid] = stdout.read(size)
            stdout.read(1)  # the newline after the content
    finally:
        writer.join()
        stdout.close()
        proc.kill()
        proc.wait()
    return out


def _is_definition_file(parts: list[str], separate: set[tuple[str, ...]]) -> bool:
    """``definition_files``'s rule, on a path split below the defs dir."""
    name, dirs = parts[-1], parts[:-1]
    if name.startswith(".") or not name.endswith(SUFFIXES):
        return False
    if any(d.startswith(".") for d in dirs):
        return False
    return not any(tuple(dirs[:i]) in separate for i in range(1, len(dirs) + 1))


def _revision_files(top: str, rel: str, commit: str
                    ) -> list[tuple[str, str, str, list[str]]] | None:
    """(mode, type, oid, path split below the defs dir) of every definition file of ``rel``
    at ``commit``, by ``definition_files``' rule; None if the defs dir did not exist."""
    prefix = "" if rel == "." else rel.rstrip("/") + "/"
    entries = _ls_tree(top, commit, [prefix] if prefix else [])
    below = [(mode, kind, oid, name[len(prefix):].split("/")) for mode, kind, oid, name in entries
             if name.startswith(prefix)]
    if not below:
        return None
    # names inside the tree only: a crafted tree's "..", "." or empty component never
    # becomes a directory made outside the temporary one (git itself refuses to check
    # them out), it is left out as git would leave it out
    below = [e for e in below if not any(p in ("", ".", "..") for p in e[3])]
    separate = {tuple(parts[:-1]) for *_, parts in below
                if parts[-1] == SEPARATE_TREE_MARKER and len(parts) > 1}
    if not separate:  # the common case, by the same rule with nothing to skip
        return [e for e in below if e[3][-1].endswith(SUFFIXES)
                and not any(p.startswith(".") for p in e[3])]
    return [e for e in below if _is_definition_file(e[3], separate)]


def load_revision(top: str, rel: str, commit: str, tmp: str,
                  parse_cache: ParseCache | None) -> LoadResult | None:
    """The definitions of ``rel`` (a defs dir, relative to ``top``) at ``commit``, read from
    git objects, with origins under ``tmp`` as if checked out there (and those directories
    made, so relative paths resolve). Only blobs the parse cache has not seen are read. None
    if the defs dir did not exist at ``commit``."""
    listed = _revision_files(top, rel, commit)
    if listed is None:
        return None
    files = sorted((os.path.join(tmp, rel, *parts), mode, kind, oid)
                   for mode, kind, oid, parts in listed)
    display_root = os.path.normpath(os.path.join(tmp, rel))
    if not files:
        raise DefinitionError(Problem(
            display_root, 0, 0, "no definitions found (no *.yaml or *.yml files)",
            hint="add definitions under base/, workspaces/, toolkits/ and envs/"))
    for d in {os.path.dirname(f) for f, *_ in files}:
        os.makedirs(d, exist_ok=True)
    problems: list[Problem] = []
    unparsed: set[str] = set()
    loaded = _load_blobs(top, files, parse_cache, problems, unparsed)
    return assemble(display_root, [loaded.get(f, []) for f, *_ in files], problems, unparsed)


def _load_blobs(top: str, files: list[tuple[str, str, str, str]], parse_cache: ParseCache | None,
                problems: list[Problem], unparsed: set[str]) -> dict[str, list[Definition]]:
    """The definitions of each (file, mode, type, oid) of a revision, read from git objects
    (only blobs the parse cache has not seen); problems and unparsed names are appended."""
    loaded: dict[str, list[Definition]] = {}
    wanted: dict[str, list[str]] = {}
    for file, mode, kind, oid in files:
        if kind != "blob" or mode not in ("100644", "100755"):
            what = "a symlink" if mode == "120000" else f"not a file (git mode {mode})"
            problems.append(Problem(file, 0, 0, f"definition file is {what} at this revision",
                                    hint="definitions at a revision are read from git as "
                                    "they are, never followed"))
            continue
        digest = parse_cache.blob(oid) if parse_cache is not None else None
        cached = parse_cache.get(digest, file) if parse_cache and digest else None
        if cached is not None:
            loaded[file] = cached
        else:
            wanted.setdefault(oid, []).append(file)
    blobs = _read_blobs(top, list(wanted), MAX_YAML_BYTES) if wanted else {}
    for oid, names in wanted.items():
        data = blobs[oid]
        for file in names:
            if isinstance(data, int):
                problems.append(Problem(file, 0, 0, f"file is {data} bytes, over the "
                                        f"{MAX_YAML_BYTES >> 20} MiB limit for a YAML/JSON "
                                        "document", hint="split it into several files"))
                continue
            digest = None
            if parse_cache is not None:
                digest = hashlib.sha256(data).hexdigest()
                parse_cache.note_blob(oid, digest)
                cached = parse_cache.get(digest, file)
                if cached is not None:
                    loaded[file] = cached
                    continue
            loaded[file] = load_bytes(data, file, problems, unparsed, parse_cache, digest)
    return loaded


def _input_paths(d: LayerDefinition) -> list[tuple[str, bool]]:
    """(path as written, read only through ``Pinner.path``) for what pinning ``d`` reads."""
    src = getattr(d, "source", None)
    out = []
    if isinstance(src, (PathSource, ArchiveSource)):
        out.append((src.path, True))
    elif isinstance(src, RootfsSource):
        out.append((src.path, False))  # also looked at with isdir
    elif isinstance(src, BusyboxSource):
        out.append((src.binary, True))
    elif isinstance(src, OciSource):
        out.append((src.layout, False))
    elif isinstance(src, DockerfileSource):
        out.append((src.context, False))
        out.append((os.path.join(src.context, src.file), False))
    out.extend((s.src, True) for s in d.steps if isinstance(s, CopyStep))
    return out


def _sha256_input(d: LayerDefinition) -> str | None:
    """The path ``d`` reads whose content its YAML pins by sha256 (an ``archive``, a ``rootfs``
    file with ``sha256``): a revision may lack it (``Pinner.read_missing_from``)."""
    src = getattr(d, "source", None)
    if isinstance(src, (ArchiveSource, RootfsSource)) and src.sha256 is not None:
        return src.path
    return None


class _NeedCheckout(Exception):
    """An input of REV that only a full checkout reads as the slow path does (a symlink on the
    way, or a path git does not have): ``keys_at_revision`` falls back to it."""


def _umask() -> int:
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_CACHEABLE_MODES = ("040000", "100644", "100755")


def materialize_inputs(top: str, commit: str, tmp: str, defs: DefinitionSet, pinner: Pinner,
                       parse_cache: ParseCache | None = None) -> list[tuple[str, str]]:
    """Make what pinning the layers of ``defs`` (origins under ``tmp``) reads inside the
    repository at ``commit`` available under ``tmp``: path sources, copy sources, archives…

    A path read only through ``Pinner.path`` whose git object (mode, id) the parse cache has
    pinned before (under this umask) is not checked out: its digest is given to ``pinner``.
    The others are checked out with a real ``git checkout-index`` (modes and filters as a fresh
    clone) through a temporary index. Paths outside the repository are left alone (pinning
    refuses or reads them as it does now). Returns (cache key, path) of what was checked out
    and may be recorded once pinned; raises ``_NeedCheckout`` for an input git cannot name
    (a symlink on its way, or missing: the full checkout reports it exactly as before).
    """
    wanted: dict[str, bool] = {}
    optional: dict[str, bool] = {}
    _wanted_paths(defs.layers, pinner, tmp, wanted, optional)
    return _materialize(top, commit, tmp, wanted, pinner, parse_cache, optional)


def _wanted_paths(layers: list[LayerDefinition], pinner: Pinner, tmp: str,
                  wanted: dict[str, bool], optional: dict[str, bool]) -> None:
    """Add what pinning ``layers`` (origins under ``tmp``) reads inside the repository to
    ``wanted``: repository path -> read only through ``Pinner.path``; and to ``optional``:
    repository path -> only ever pinned by a sha256 of the YAML (``_sha256_input``)."""
    for d in layers:
        base_dir = pinner.directory_of(d.origin.file)
        by_sha256 = _sha256_input(d)
        for p, through_path in _input_paths(d):
            if os.path.isabs(p):
                continue
            rel = os.path.relpath(os.path.normpath(os.path.join(base_dir, p)), tmp)
            if rel != "." and not rel.startswith(".."):
                wanted[rel] = wanted.get(rel, True) and through_path
                optional[rel] = optional.get(rel, True) and p == by_sha256


def _materialize(top: str, commit: str, tmp: str, wanted: dict[str, bool], pinner: Pinner,
                 parse_cache: ParseCache | None, optional: dict[str, bool]
                 ) -> list[tuple[str, str]]:
    """``materialize_inputs`` of the paths ``wanted`` (relative to the repository, each
    True when read only through ``Pinner.path``); a path ``optional`` says only a sha256 of
    the YAML pins may be missing at the commit (the pinner reads the working tree's)."""
    if not wanted:
        return []
    found = {name: (mode, oid) for mode, _, oid, name in _ls_tree(top, commit, sorted(wanted),
                                                                     recursive=False)}
    umask = _umask()
    checkout: list[str] = []
    record: list[tuple[str, str]] = []
    for rel, through_path in sorted(wanted.items()):
        if rel not in found and optional.get(rel):
            continue
        if rel not in found or found[rel][0] == "120000":
            raise _NeedCheckout(rel)
        mode, oid = found[rel]
        key = f"pin:{mode}:{oid}:{umask:o}" if mode in _CACHEABLE_MODES and through_path else None
        digest = parse_cache.pin(key) if key is not None and parse_cache is not None else None
        if digest is not None:
            pinner.known(os.path.join(tmp, rel), digest)
            continue
        checkout.append(rel)
        if key is not None:
            record.append((key, os.path.join(tmp, rel)))
    if not checkout:
        return record
    kept: list[str] = []
    for p in checkout:  # sorted: "a" covers "a/b", list each file once
        if not kept or not p.startswith(kept[-1] + "/"):
            kept.append(p)
    listing = _ls_tree(top, commit, kept)
    env = {"GIT_INDEX_FILE": os.path.join(os.path.dirname(tmp), "index")}
    index_info = "".join(f"{m} {k} {o}\t{n}\0" for m, k, o, n in listing if k == "blob")
    try:
        done = subprocess.run(["git", "update-index", "-z", "--index-info"], cwd=top,
                              input=index_info.encode(), capture_output=True, check=False,
                              env={**git_env(), **env})
    except FileNotFoundError:
        raise SourceError("git is not installed", hint="apt-get install git") from None
    if done.returncode != 0:
        raise SourceError(f"git update-index exited {done.returncode}",
                          context=done.stderr.decode(errors="replace")[-2000:])
    _git(["checkout-index", "--all", "--force", f"--prefix={tmp}/"], top, env)
    return record


#: ``_keys_from_delta`` loads REV whole when more than this share of its files changed.
DELTA_MAX_SHARE = 0.2
#: Sources whose pins at REV follow from the digests of their paths (``_input_paths``) alone;
#: a git source only with a remote URL (the same pinner resolves it the same way).
_DELTA_SOURCES = (type(None), ScratchSource, DebootstrapSource, BaseSource, ImageSource,
                  PathSource, ArchiveSource, BusyboxSource, GitSource)


def _keys_from_delta(top: str, rel: str, commit: str, tmp: str, pinner: Pinner,
                     cache: ParseCache, now: Snapshot) -> KeySet | None:
    """REV's keys as the working tree's (``now``, loaded with ``cache``) changed where REV
    differs, without loading, checking or pinning REV whole; None when this way cannot tell
    (a problem at REV, a Dockerfile base, many changed files): then REV is loaded whole, which
    reports any problem exactly.

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
    """
    listed = _revision_files(top, rel, commit)
    if listed is None or any(k != "blob" or m not in ("100644", "100755")
                             for m, k, _, _ in listed):
        return None
    root = now.defs.root
    prefix = "" if root == "." else root + "/"  # how the loader names the files below root
    if root.endswith("/"):
        return None
    by_file: dict[str, list[str]] = {}
    for n, d in now.defs.by_name.items():
        by_file.setdefault(d.origin.file, []).append(n)
    tree = cache.tree_files
    now_oids: dict[str, str] = {}
    for f in by_file:
        oid = tree.get(f)
        if oid is None or not f.startswith(prefix):
            return None
        now_oids[f[len(prefix):]] = oid
    rev_oids = {"/".join(parts): oid for _, _, oid, parts in listed}
    changed = sorted({p for p, o in rev_oids.items() if now_oids.get(p) != o}
                     | (now_oids.keys() - rev_oids.keys()))
    if len(changed) > max(64, DELTA_MAX_SHARE * len(rev_oids)):
        return None

    def rev_file(path: str) -> str:  # where load_revision puts the file of REV at ``path``
        return os.path.join(tmp, rel, *path.split("/"))

    problems: list[Problem] = []
    files = [(rev_file(p), "100644", "blob", rev_oids[p]) for p in changed if p in rev_oids]
    loaded = _load_blobs(top, files, cache, problems, set())
    if problems:
        return None
    removed = {n for p in changed if p in now_oids for n in by_file[prefix + p]}
    by_name = dict(now.defs.by_name)
    for n in removed:
        del by_name[n]
    new_defs: list[Definition] = []
    for f, *_ in files:
        for d in loaded[f]:
            if d.name in by_name:
                return None  # a duplicate name: the whole load reports it
            by_name[d.name] = d
            new_defs.append(d)
    if any(isinstance(getattr(d, "source", None), DockerfileSource) for d in by_name.values()):
        return None  # its FROM envs are read from the Dockerfile when the tree is loaded

    # the graph checks of what can have changed
    names = removed | {d.name for d in new_defs}
    now_preds = now.graph.preds
    succs = _successors(now.graph)
    referrers = {m for n in names for m in succs.get(n, ()) if m not in names}
    layers = [n for n in referrers if by_name[n].kind in ("Workspace", "Toolkit")]
    referrers.update(m for n in layers for m in succs.get(n, ())
                     if m not in names and by_name[m].kind == "Env")
    preds = dict(now_preds)
    for n in removed:
        del preds[n]
    check = [by_name[n] for n in sorted(referrers)] + new_defs
    for d in check:
        preds[d.name] = []
    if check_references(by_name, check, preds):
        return None
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
                return None  # a cycle
    display_root = os.path.normpath(os.path.join(tmp, rel))

    # pins: unchanged definitions keep theirs where every path they read is the same at REV
    slow: dict[str, Definition] = {d.name: d for d in new_defs if d.kind != "Env"}
    rev_dirs: dict[str, str] = {}
    groups: dict[tuple[str, str, str], list[str]] = {}
    wanted: dict[str, bool] = {}
    optional: dict[str, bool] = {}
    group_rel: dict[tuple[str, str, str], str] = {}
    for n, d in now.defs.by_name.items():
        if n in removed or d.kind == "Env":
            continue
        src = getattr(d, "source", None)
        now_dir = pinner.directory_of(d.origin.file)
        if not isinstance(src, _DELTA_SOURCES) or (
                isinstance(src, GitSource) and local_git_path(src.url, now_dir) is not None):
            slow[n] = d
            continue
        reads = _input_paths(d)  # type: ignore[arg-type]
        if not reads:
            continue
        at_rev = rev_dirs.get(now_dir)
        if at_rev is None:
            at_rev = rev_dirs[now_dir] = pinner.directory_of(
                rev_file(d.origin.file[len(prefix):]))
        for path, through_path in reads:
            group = (now_dir, at_rev, path)
            users = groups.get(group)
            if users is None:
                rel_path = (None if os.path.isabs(path) else
                            os.path.relpath(os.path.normpath(os.path.join(at_rev, path)), tmp))
                if rel_path is None or rel_path == "." or rel_path.startswith(".."):
                    slow[n] = d
                    break
                users = groups[group] = []
                group_rel[group] = rel_path
                wanted[rel_path] = wanted.get(rel_path, True) and through_path
            users.append(n)
            rp = group_rel[group]
            optional[rp] = optional.get(rp, True) and path == _sha256_input(d)
    new_names = {d.name for d in new_defs}  # placed at REV's files already
    placed = {n: d if n in new_names else cache.place(d, rev_file(d.origin.file[len(prefix):]))
              for n, d in slow.items()}
    _wanted_paths(list(placed.values()), pinner, tmp, wanted, optional)  # type: ignore[arg-type]
    record = _materialize(top, commit, tmp, wanted, pinner, cache, optional)
    for (now_dir, at_rev, path), users in groups.items():
        try:
            same = pinner.path(now_dir, path) == pinner.path(at_rev, path)
        except Unpinnable:
            same = False  # pinned at REV as usual: that reports it
        if not same:
            for n in users:
                if n not in placed:
                    placed[n] = cache.place(now.defs.by_name[n],
                                            rev_file(now.defs.by_name[n].origin.file[len(prefix):]))
    for d in placed.values():
        os.makedirs(pinner.directory_of(d.origin.file), exist_ok=True)
    try:
        pins = pin_inputs(DefinitionSet(root=display_root, by_name=MappingProxyType(placed)),
                          pinner)
    except EnvbuildError:
        return None
    pinned = dict(now.pinned)
    for n in removed | placed.keys():
        pinned.pop(n, None)
    pinned.update(pins)
    by_name.update(placed)
    for key, path in record:
        digest = pinner.digest_of(path)
        if digest is not None:
            cache.note_pin(key, digest)
    graph = EnvGraph(defs=DefinitionSet(root=display_root, by_name=MappingProxyType(by_name)),
                     preds=preds)
    # what can have another key: the changed and re-pinned definitions and their dependents
    # at REV (the others are now's definitions, pins and upstreams: now's keys)
    dirty = new_names | placed.keys()  # a name of a changed file is new even if it was there
    new_succs: dict[str, list[str]] = {}
    for d in new_defs:
        for dep in preds[d.name]:
            new_succs.setdefault(dep, []).append(d.name)
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


def _successors(graph: EnvGraph) -> dict[str, list[str]]:
    """Name -> the names that depend on it directly, once per graph."""
    succs = graph._memo.get("succs")
    if succs is None:
        succs = graph._memo["succs"] = {}
        for n, deps in graph.preds.items():
            for dep in deps:
                succs.setdefault(dep, []).append(n)
    return succs


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
    top, rel, commit = _revision(defs_dir, rev)
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
    except _NeedCheckout:
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
        pinner.read_missing_from(str(root), _revision(defs_dir, rev)[0])
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
    old = keys_at_revision(defs_dir, rev, pinner) if rev is not None else None
    return explain(name, by_name[name].kind, now.keys, old)
