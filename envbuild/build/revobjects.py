"""A definition tree at a git revision, read from git objects (side effects: runs git).

The plumbing of ``envbuild.build.gitrev`` (which documents the whole approach): resolve a
revision (``revision``), list and read a revision's definition files (``revision_files``,
``load_revision``, ``load_blobs``: blob ids and names inside the tree, never a path followed on
disk), and make what pinning reads available under a temporary directory laid out like a
checkout (``materialize_inputs``: ``git checkout-index`` from a temporary index, or a digest the
parse cache knows by git object id). ``checkout`` is the full checkout of the reference path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from envbuild.build.gitoid import is_git_oid
from envbuild.build.pin import Pinner, git_env
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
    BusyboxSource,
    CopyStep,
    Definition,
    DefinitionSet,
    DockerfileSource,
    LayerDefinition,
    OciSource,
    PathSource,
    RootfsSource,
)
from envbuild.defs.parsecache import ParseCache
from envbuild.errors import DefinitionError, Problem, SourceError


def git_output(argv: list[str], cwd: str, env: dict[str, str] | None = None) -> str:
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


def revision(path: Path, rev: str) -> tuple[str, str, str]:
    """(top of the work tree holding ``path``, ``path`` relative to it, the commit id ``rev``
    names). ``rev`` is given to git only after ``--end-of-options``; later calls get the id."""
    here = _existing_ancestor(path)
    try:
        top = git_output(["rev-parse", "--show-toplevel"], str(here)).strip()
    except SourceError as e:
        raise SourceError(f"{path} is not inside a git repository",
                          hint="--changed-since/--against need the definitions in git") from e
    rel = os.path.relpath(os.path.realpath(path.absolute()), os.path.realpath(top))
    try:
        commit = git_output(["rev-parse", "--verify", "--quiet", "--end-of-options",
                       f"{rev}^{{commit}}"], top).strip()
    except SourceError:
        raise SourceError(f"unknown git revision {rev!r}",
                          hint="give a commit, branch or tag, e.g. HEAD~1 or origin/main") from None
    if not is_git_oid(commit):
        raise SourceError(f"git rev-parse {rev!r} printed {commit[:80]!r}, not a commit id")
    return top, rel, commit


@contextlib.contextmanager
def checkout(path: Path, rev: str) -> Iterator[tuple[Path, Path]]:
    """Yield (root of a temporary checkout of ``rev``, where ``path`` is inside it).

    ``path`` must be inside a git work tree; where it is at ``rev`` may not exist. The whole
    repository is checked out: ``keys_at_revision`` does not need this (it reads git objects),
    it is the reference the fast path is tested against.
    """
    top, rel, commit = revision(path, rev)
    with tempfile.TemporaryDirectory(prefix="envbuild-rev-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        tree = os.path.join(tmp, "tree")
        git_output(["read-tree", "--end-of-options", commit], top, env)
        git_output(["checkout-index", "--all", "--force", f"--prefix={tree}/"], top, env)
        yield Path(tree), Path(tree) / rel


_LITERAL = {"GIT_LITERAL_PATHSPECS": "1"}  # a path is a name, never a pathspec pattern


def ls_tree(top: str, commit: str, paths: list[str], recursive: bool = True
             ) -> list[tuple[str, str, str, str]]:
    """(mode, type, oid, path) of the entries of ``commit`` under ``paths`` (repo-relative;
    ``[]`` = all), from ``git ls-tree -z``: names inside the tree, never a file on disk."""
    argv = ["ls-tree", "-z", "--full-tree", *(["-r"] if recursive else []),
            "--end-of-options", commit, "--", *paths]
    out = []
    for record in git_output(argv, top, _LITERAL).split("\0"):
        if record:
            meta, _, name = record.partition("\t")
            mode, kind, oid = meta.split(" ")
            out.append((mode, kind, oid, name))
    return out


def read_blobs(top: str, oids: list[str], limit: int) -> dict[str, bytes | int]:
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


def revision_files(top: str, rel: str, commit: str
                    ) -> list[tuple[str, str, str, list[str]]] | None:
    """(mode, type, oid, path split below the defs dir) of every definition file of ``rel``
    at ``commit``, by ``definition_files``' rule; None if the defs dir did not exist."""
    prefix = "" if rel == "." else rel.rstrip("/") + "/"
    entries = ls_tree(top, commit, [prefix] if prefix else [])
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
    listed = revision_files(top, rel, commit)
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
    loaded = load_blobs(top, files, parse_cache, problems, unparsed)
    return assemble(display_root, [loaded.get(f, []) for f, *_ in files], problems, unparsed)


def load_blobs(top: str, files: list[tuple[str, str, str, str]], parse_cache: ParseCache | None,
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
    blobs = read_blobs(top, list(wanted), MAX_YAML_BYTES) if wanted else {}
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


def input_paths(d: LayerDefinition) -> list[tuple[str, bool]]:
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


def sha256_input(d: Definition) -> str | None:
    """The path ``d`` reads whose content its YAML pins by sha256 (an ``archive``, a ``rootfs``
    file with ``sha256``): a revision may lack it (``Pinner.read_missing_from``)."""
    src = getattr(d, "source", None)
    if isinstance(src, (ArchiveSource, RootfsSource)) and src.sha256 is not None:
        return src.path
    return None


class NeedCheckout(Exception):
    """An input of REV that only a full checkout reads as the slow path does (a symlink on the
    way, or a path git does not have): ``keys_at_revision`` falls back to it."""


def current_umask() -> int:
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
    and may be recorded once pinned; raises ``NeedCheckout`` for an input git cannot name
    (a symlink on its way, or missing: the full checkout reports it exactly as before).
    """
    wanted: dict[str, bool] = {}
    optional: dict[str, bool] = {}
    wanted_paths(defs.layers, pinner, tmp, wanted, optional)
    return materialize(top, commit, tmp, wanted, pinner, parse_cache, optional)


def wanted_paths(layers: list[LayerDefinition], pinner: Pinner, tmp: str,
                  wanted: dict[str, bool], optional: dict[str, bool]) -> None:
    """Add what pinning ``layers`` (origins under ``tmp``) reads inside the repository to
    ``wanted``: repository path -> read only through ``Pinner.path``; and to ``optional``:
    repository path -> only ever pinned by a sha256 of the YAML (``sha256_input``)."""
    for d in layers:
        base_dir = pinner.directory_of(d.origin.file)
        by_sha256 = sha256_input(d)
        for p, through_path in input_paths(d):
            if os.path.isabs(p):
                continue
            rel = os.path.relpath(os.path.normpath(os.path.join(base_dir, p)), tmp)
            if rel != "." and not rel.startswith(".."):
                wanted[rel] = wanted.get(rel, True) and through_path
                optional[rel] = optional.get(rel, True) and p == by_sha256


def materialize(top: str, commit: str, tmp: str, wanted: dict[str, bool], pinner: Pinner,
                 parse_cache: ParseCache | None, optional: dict[str, bool]
                 ) -> list[tuple[str, str]]:
    """``materialize_inputs`` of the paths ``wanted`` (relative to the repository, each
    True when read only through ``Pinner.path``); a path ``optional`` says only a sha256 of
    the YAML pins may be missing at the commit (the pinner reads the working tree's)."""
    if not wanted:
        return []
    found = {name: (mode, oid) for mode, _, oid, name in ls_tree(top, commit, sorted(wanted),
                                                                     recursive=False)}
    umask = current_umask()
    checkout: list[str] = []
    record: list[tuple[str, str]] = []
    for rel, through_path in sorted(wanted.items()):
        if rel not in found and optional.get(rel):
            continue
        if rel not in found or found[rel][0] == "120000":
            raise NeedCheckout(rel)
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
    listing = ls_tree(top, commit, kept)
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
    git_output(["checkout-index", "--all", "--force", f"--prefix={tmp}/"], top, env)
    return record
