"""Pinning: turn what definitions read from disk (or git) into content digests.

Keys are computed only over pinned inputs (STYLE.md principle 4). This module is the side-effect
half: it reads files, walks trees and asks git; ``envbuild.plan.keys`` hashes the result.

What is pinned, per definition (``PinnedInputs[name][field]``):

==================================  ===========================================================
``source`` of a ``path`` source     tree digest of the directory (below)
``source`` of an ``archive``        ``sha256:`` of the file, checked against the declared sha256
``source`` of a ``git`` source      the commit sha ``rev`` resolves to (``git rev-parse`` for a
                                    local path or ``file://`` URL, ``git ls-remote`` otherwise)
``source`` of ``rootfs``            tree digest of a directory, or ``sha256:`` of a tarball
                                    (checked against the declared sha256 when there is one)
``source`` of ``oci``               the manifest digest ``ref`` names in the layout's index.json
``source`` of ``busybox``           ``sha256:`` of the binary
``source*`` of ``dockerfile``       the context digest, the Dockerfile's sha256 and each
                                    ``FROM`` digest (``envbuild.build.dockerpin``)
``steps[i].copy.src``               tree digest of a directory or ``sha256:`` of a file
``hidden`` of a Task                as the ``source`` of a workspace (the same kinds)
``debootstrap``, ``scratch``,       nothing: debootstrap's inputs are its suite/variant/include
``base``                            (in the key); a parent base enters as its key
==================================  ===========================================================

Relative paths resolve against the directory of the definition file (``origin.directory``).
**Confinement** (a definition is hostile input): every path a definition names — ``copy.src``,
a workspace's ``path``, ``archive`` and local or ``file://`` ``git`` sources, a base's
``rootfs``, ``oci`` layout, ``busybox`` binary and Dockerfile context — must resolve (symlinks
followed) inside the *source root*, the parent of the definitions directory (the repository
holding ``envdefs/`` and the ``sources/`` that ``../../sources/x`` names); ``/etc``,
``../../../../etc`` or a symlink out are refused at the definition's line. Two exceptions:
the host's busybox package binary (``HOST_BUSYBOX``, the default of ``from: {busybox}``),
and the *trusted directories* the one running the build names (``--trust-sources DIR``,
``ENVBUILD_TRUSTED_SOURCES``; ``envbuild.settings.trusted_sources``): the operator's opt-in
for a definition tree it trusts, never something a definition can grant itself. Inside a
copied tree, symlinks are copied as links and never followed.

**Git** (a definition is hostile input): the url must be ``https``/``http``/``ssh``/``git``/
``file`` URL, scp-like ``[user@]host:path`` or a local path, never start with ``-`` and never
name a ``transport::`` (``ext::`` runs a command); a rev is a commit id or a ref name not
starting with ``-``. Every git call puts ``--end-of-options``/``--`` before URLs and revs, and
runs with ``GIT_ALLOW_PROTOCOL`` so git itself refuses any other transport (``git_env``).

**Tree digest v1** — ``sha256:`` of ``b"envbuild.tree.v1\\0"`` followed by one record per entry,
the root first (as ``.``), then depth-first with the names of each directory sorted by their
bytes. A record is ``TYPE\\0MODE\\0PATH\\0EXTRA\\0`` where TYPE is ``d``/``f``/``l``/``p``/``s``
/``c``/``b``, MODE the permission bits in octal (``0`` for symlinks, whose bits mean nothing),
PATH the ``/``-joined name relative to the root, and EXTRA the file's size and sha256
(``SIZE:HEX``), a symlink's target, a device's ``MAJOR,MINOR``, or empty. Never hashed:
mtimes, owners, absolute paths — so a copy of the tree elsewhere, or a fresh checkout, hashes the
same. Ignored (version-control and interpreter caches that do not belong in a layer): any entry
named ``.git`` (directory, or a submodule's ``.git`` file), ``__pycache__``,
``.pytest_cache``, ``.mypy_cache`` and ``.ruff_cache`` directories (running a project's tests
on the host must not change its key) and ``*.pyc`` files. The importers leave out exactly the
same entries, so a key always describes its layer. Nothing else is skipped: an unreadable
file is an error, not a gap.

Every digest is computed once per ``Pinner`` (per run): many definitions sharing a source
directory cost one walk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import stat
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Literal
from urllib.parse import unquote, urlsplit

from envbuild.build.dockerpin import check_image_pinned, pin_dockerfile
from envbuild.build.gitoid import is_git_oid
from envbuild.canonical import read_json_file
from envbuild.defs.confine import (  # noqa: F401  (source_root, confined_path: re-exported)
    Unpinnable,
    confined_path,
    source_root,
    source_roots,
    within,
)
from envbuild.defs.model import (
    ArchiveSource,
    BusyboxSource,
    CopyStep,
    DefinitionSet,
    DockerfileSource,
    GitSource,
    ImageSource,
    LayerDefinition,
    OciSource,
    PathSource,
    RootfsSource,
)
from envbuild.defs.parsecache import ParseCache
from envbuild.errors import SourceError
from envbuild.plan.graph import EnvGraph, field_position
from envbuild.plan.keys import KeyMemo, KeySet, PinnedInputs, Previous, compute_keys
from envbuild.plan.taskplan import HIDDEN_PIN, hidden_definition
from envbuild.settings import trusted_sources

TREE_TAG = b"envbuild.tree.v1\0"
IGNORED_NAMES = frozenset({".git"})
IGNORED_DIR_NAMES = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"})
IGNORED_FILE_SUFFIXES = (".pyc",)
_BUF_SIZE = 1 << 20
_OCI_REF_NAME = "org.opencontainers.image.ref.name"


#: Transports git may use for any command envbuild runs (``ext``/``fd`` are never allowed).
GIT_ALLOWED_PROTOCOLS = "file:git:http:https:ssh"
_GIT_URL_RE = re.compile(
    r"(?:https?|ssh|git|file)://[^\s]+"                       # scheme://...
    r"|(?:[A-Za-z0-9._~+][A-Za-z0-9._~+-]*@)?[A-Za-z0-9][A-Za-z0-9.-]*:(?!:)[^\s]*"  # scp-like
    r"|(?!-)[^:\x00-\x1f]+")                                  # a local path (no colon)
_GIT_REV_RE = re.compile(r"(?!-)[A-Za-z0-9._/@+~^{}-]+")


def git_env() -> dict[str, str]:
    """The environment of every git subprocess: no prompts, C locale, and only the transports
    of ``GIT_ALLOWED_PROTOCOLS`` (git refuses ``ext::``/``fd::`` even if a URL names one)."""
    return {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true", "LC_ALL": "C",
            "GIT_ALLOW_PROTOCOL": GIT_ALLOWED_PROTOCOLS, "GIT_PROTOCOL_FROM_USER": "0"}


def git_source_problem(url: str, rev: str) -> str | None:
    """Why ``url``/``rev`` cannot be given to git (None if they can): a URL that git could read
    as an option or a command-running transport, or a rev that could be an option."""
    if not _GIT_URL_RE.fullmatch(url) or url.startswith("-") or "::" in url.split("/", 1)[0]:
        return (f"git url {url!r} is not an allowed URL (https, http, ssh, git, file, "
                "user@host:path or a local path, not starting with '-')")
    if not _GIT_REV_RE.fullmatch(rev):
        return f"git rev {rev!r} is not a commit id or ref name (it must not start with '-')"
    return None


def check_git_source(url: str, rev: str) -> None:
    """``git_source_problem`` as an exception (``SourceError``), for the importers."""
    problem = git_source_problem(url, rev)
    if problem is not None:
        raise SourceError(problem, hint="fix source.git in the definition")


def _run_git(argv: list[str], what: str) -> str:
    env = git_env()
    try:
        done = subprocess.run(["git", *argv], capture_output=True, text=True, env=env,
                              timeout=120, check=False)
    except FileNotFoundError:
        raise Unpinnable(f"{what}: git is not installed",
                          "install git (apt-get install git)") from None
    except subprocess.TimeoutExpired:
        raise Unpinnable(f"{what}: git {argv[0]} timed out after 120 s") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise Unpinnable(f"{what}: git {argv[0]} exited {done.returncode}: {tail}")
    return done.stdout


class Pinner:
    """Computes digests, each at most once per instance (one instance per run)."""

    def __init__(self, run_git: Callable[[list[str], str], str] = _run_git,
                 trusted: Sequence[str] | None = None) -> None:
        self._run_git = run_git
        #: directories outside the source root sources may name (None: from the environment)
        self.trusted = tuple(trusted) if trusted is not None else trusted_sources(os.environ)
        self._by_spelling: dict[str, str] = {}   # joined path as written -> digest
        self._by_real: dict[str, str] = {}       # realpath -> digest
        self._git: dict[tuple[str, str], str] = {}
        self._confined: dict[tuple[tuple[str, ...], str, str], str | Unpinnable] = {}
        self._dirs: dict[str, str] = {}
        #: (revision root, working tree root): see ``read_missing_from``
        self._worktrees: list[tuple[str, str]] = []
        self._buf = bytearray(_BUF_SIZE)
        self._view = memoryview(self._buf)

    def read_missing_from(self, rev_root: str, work_root: str) -> None:
        """Files under ``rev_root`` (a revision's tree laid out as the repository at
        ``work_root``) that the YAML pins by sha256 and that the revision lacks (an archive too
        big to commit, or ignored) are read from the working tree at the same place: the
        sha256 pins their content, so a file there with that sha256 is the one REV meant, and
        one without it is a mismatch (``by_sha256``)."""
        self._worktrees.append((os.path.normpath(rev_root), os.path.normpath(work_root)))

    def by_sha256(self, base_dir: str, rel: str, declared: str | None,
                  roots: tuple[str, ...] | None) -> str:
        """``path`` of a file the definition pins by its ``declared`` sha256 (an ``archive``,
        a ``rootfs`` tarball), checked against it; a file a revision lacks is read from the
        working tree (``read_missing_from``), confined to the working tree's source roots."""
        try:
            digest = self.path(base_dir, rel)
        except Unpinnable:
            spelled = os.path.normpath(os.path.join(base_dir, rel))
            moved = None if declared is None or os.path.lexists(spelled) else self._moved(spelled)
            if moved is None:
                raise
            rev_root, work_root = moved
            work = work_root + spelled[len(rev_root):]
            if roots is not None:
                self.confined(tuple(work_root + r[len(rev_root):] if within(r, rev_root) else r
                                    for r in roots), os.path.dirname(work), os.path.basename(work))
            digest = self.path(os.path.dirname(work), os.path.basename(work))
            _check_sha256(digest, declared, f"{rel} is not in the revision's tree and the working "
                                             f"tree's {work} does not match",
                          "commit the file, or compare against a revision whose definition "
                          "declares the working tree's file")
            return digest
        _check_sha256(digest, declared, rel)
        return digest

    def _moved(self, path: str) -> tuple[str, str] | None:
        return next(((rev, work) for rev, work in self._worktrees if within(path, rev)), None)

    def directory_of(self, file: str) -> str:
        """``str(Origin.directory)`` of a definition in ``file``, computed once per file."""
        found = self._dirs.get(file)
        if found is None:
            found = os.path.dirname(file)
            if not found or "//" in file or "/./" in f"/{found}/" or found.endswith("/"):
                found = str(Path(file).parent)  # the spellings Path normalises
            self._dirs[file] = found
        return found

    def known(self, path: str, digest: str) -> None:
        """Record the digest of ``path`` (found as its realpath), computed elsewhere: a
        revision's source tree by git object id (``envbuild.build.gitrev``)."""
        self._by_real[os.path.realpath(path)] = digest

    def digest_of(self, path: str) -> str | None:
        """The digest this run computed for ``path`` (by realpath), if any."""
        return self._by_real.get(os.path.realpath(path))

    def confined(self, roots: tuple[str, ...], base_dir: str, rel: str) -> str:
        """``confined_path``, once per (roots, base_dir, rel) and run: 100,000 workspaces
        naming a few shared source directories cost a few ``realpath`` calls, not 100,000."""
        key = (roots, base_dir, rel)
        found = self._confined.get(key)
        if found is None:
            try:
                found = confined_path(roots, base_dir, rel)
            except Unpinnable as e:
                found = e
            self._confined[key] = found
        if isinstance(found, Unpinnable):
            raise Unpinnable(found.message, found.hint)
        return found

    # ------------------------------------------------------------------ files and trees

    def path(self, base_dir: str, rel: str) -> str:
        """Tree digest of a directory or ``sha256:`` of a file, ``rel`` resolved in base_dir."""
        spelled = os.path.join(base_dir, rel)
        d = self._by_spelling.get(spelled)
        if d is None:
            real = os.path.realpath(spelled)
            d = self._by_real.get(real)
            if d is None:
                try:
                    st = os.stat(real)
                except FileNotFoundError:
                    raise Unpinnable(f"{rel}: no such file or directory",
                                      f"it is resolved against {base_dir or '.'}/") from None
                except OSError as e:
                    raise Unpinnable(f"stat {rel}: {e.strerror}") from None
                d = self.tree(real) if stat.S_ISDIR(st.st_mode) else self.file(real)
                self._by_real[real] = d
            self._by_spelling[spelled] = d
        return d

    def file(self, path: str) -> str:
        return "sha256:" + self._file_sha256(path).hex()

    def _file_sha256(self, path: str) -> bytes:
        h = hashlib.sha256()
        buf, view = self._buf, self._view
        try:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    h.update(view[:n])
        except OSError as e:
            raise Unpinnable(f"read {path}: {e.strerror}") from None
        return h.digest()

    def tree(self, root: str) -> str:
        """Tree digest v1 of directory ``root`` (see the module docstring)."""
        h = hashlib.sha256(TREE_TAG)
        st = os.stat(root)
        h.update(b"d\0%o\0.\0\0" % stat.S_IMODE(st.st_mode))
        self._walk(root, b"", h)
        return "sha256:" + h.hexdigest()

    def _walk(self, dirpath: str, rel: bytes, h) -> None:
        try:
            with os.scandir(dirpath) as it:
                entries = sorted(it, key=lambda e: os.fsencode(e.name))
        except OSError as e:
            raise Unpinnable(f"list {dirpath}: {e.strerror}") from None
        for ent in entries:
            name = ent.name
            if name in IGNORED_NAMES:
                continue
            st = ent.stat(follow_symlinks=False)
            mode = st.st_mode
            path = rel + os.fsencode(name)
            if stat.S_ISDIR(mode):
                if name in IGNORED_DIR_NAMES:
                    continue
                h.update(b"d\0%o\0%b\0\0" % (stat.S_IMODE(mode), path))
                self._walk(ent.path, path + b"/", h)
            elif stat.S_ISREG(mode):
                if name.endswith(IGNORED_FILE_SUFFIXES):
                    continue
                digest = self._file_sha256(ent.path)
                h.update(b"f\0%o\0%b\0%d:%b\0" % (stat.S_IMODE(mode), path, st.st_size,
                                                  digest.hex().encode()))
            elif stat.S_ISLNK(mode):
                h.update(b"l\x000\0%b\0%b\0" % (path, os.fsencode(os.readlink(ent.path))))
            else:
                kind = (b"p" if stat.S_ISFIFO(mode) else b"s" if stat.S_ISSOCK(mode)
                        else b"c" if stat.S_ISCHR(mode) else b"b")
                extra = (b"%d,%d" % (os.major(st.st_rdev), os.minor(st.st_rdev))
                         if kind in (b"c", b"b") else b"")
                h.update(b"%b\0%o\0%b\0%b\0" % (kind, stat.S_IMODE(mode), path, extra))

    # ------------------------------------------------------------------ git and oci

    def git(self, url: str, rev: str, base_dir: str) -> str:
        """The commit sha ``rev`` names in the repository at ``url``."""
        problem = git_source_problem(url, rev)
        if problem is not None:
            raise Unpinnable(problem, "use https://, ssh://, git@host:path or a local path")
        local = local_git_path(url, base_dir)
        cache_key = (local or url, rev)
        sha = self._git.get(cache_key)
        if sha is None:
            sha = self._resolve_git(url, local, rev)
            self._git[cache_key] = sha
        return sha

    def _resolve_git(self, url: str, local: str | None, rev: str) -> str:
        hint = f"check that {rev!r} is a branch, tag or commit of {url}"
        if local is not None:
            if not os.path.isdir(local):
                raise Unpinnable(f"git repository {url}: no such directory {local}",
                                  "a relative url is resolved against the definition's directory")
            try:
                out = self._run_git(["-C", local, "rev-parse", "--verify", "--quiet",
                                     "--end-of-options", f"{rev}^{{commit}}"],
                                    f"resolve {rev!r} in {url}")
            except Unpinnable as e:
                raise Unpinnable(e.message, hint) from None
            sha = out.strip()
            if not is_git_oid(sha):
                raise Unpinnable(f"resolve {rev!r} in {url}: git printed {sha[:60]!r}", hint)
            return sha
        if is_git_oid(rev.lower()):
            return rev.lower()  # a full commit id is already pinned; ls-remote cannot list it
        try:
            out = self._run_git(["-c", "protocol.ext.allow=never", "ls-remote", "--", url, rev],
                                f"resolve {rev!r} in {url}")
        except Unpinnable as e:
            raise Unpinnable(e.message, hint) from None
        refs = {}
        for line in out.splitlines():
            sha, _, ref = line.partition("\t")
            refs[ref] = sha
        for want in (f"refs/tags/{rev}^{{}}", f"refs/tags/{rev}", f"refs/heads/{rev}", rev):
            if want in refs and is_git_oid(refs[want].lower()):
                return refs[want].lower()
        raise Unpinnable(f"git rev {rev!r} not found in {url}", hint)

    def oci(self, layout: str, ref: str) -> str:
        """The manifest digest ``ref`` (a ref name, or a digest) names in an OCI layout."""
        index_path = os.path.join(layout, "index.json")
        try:
            index = read_json_file(index_path)  # bounded: the layout is untrusted input
            if not isinstance(index, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            raise Unpinnable(f"{layout}: not an OCI layout (no index.json)",
                              "create it with `skopeo copy docker://IMAGE oci:DIR:TAG`") from None
        except (OSError, ValueError) as e:
            raise Unpinnable(f"read {index_path}: {e}") from None
        manifests = index.get("manifests") or []
        names = sorted({(m.get("annotations") or {}).get(_OCI_REF_NAME, "") for m in manifests}
                       - {""})
        found = {m["digest"] for m in manifests
                 if m.get("digest") == ref
                 or (m.get("annotations") or {}).get(_OCI_REF_NAME) == ref}
        if len(found) == 1:
            return found.pop()
        if not found:
            raise Unpinnable(f"{layout}: no manifest for ref {ref!r}",
                              f"refs in index.json: {', '.join(names) or '(none)'}")
        raise Unpinnable(f"{layout}: ref {ref!r} names {len(found)} manifests",
                          "use the manifest digest as ref")


def local_git_path(url: str, base_dir: str) -> str | None:
    """A filesystem path for a local or ``file://`` URL, else None (remote)."""
    if url.startswith("file://"):
        return unquote(urlsplit(url).path)
    if "://" in url or re.match(r"^[^/]+@[^/]+:", url) or re.match(r"^[A-Za-z0-9.-]+:[^/]", url):
        return None  # https://, ssh://, git@host:path, host:path
    return os.path.normpath(os.path.join(base_dir, url))


#: The host's busybox package binary (busybox-static; ``/bin`` may be a link to ``/usr/bin``):
#: what ``from: {busybox}`` names by default, allowed without a trusted directory. Public
#: bytes, and the path is checked after resolving links, so a link there to a secret is not.
HOST_BUSYBOX = frozenset({"/bin/busybox", "/usr/bin/busybox"})

_ELF_PT_INTERP = 3


def static_elf_problem(path: str) -> str | None:
    """Why ``path`` is not a static ELF executable (None if it is): what a busybox rootfs
    needs (it has no libc), checked before the binary is run to list its applets (on the host
    for ``HOST_BUSYBOX``, else in a container). The message shows none of the file's bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) \
                    or head[5] not in (1, 2):
                return f"busybox binary {path} is not a static ELF executable (not ELF)"
            order: Literal["little", "big"] = "little" if head[5] == 1 else "big"
            wide = head[4] == 2
            e_type = int.from_bytes(head[16:18], order)
            phoff = int.from_bytes(head[32:40] if wide else head[28:32], order)
            phentsize = int.from_bytes(head[54:56] if wide else head[42:44], order)
            phnum = int.from_bytes(head[56:58] if wide else head[44:46], order)
            if e_type not in (2, 3) or not 4 <= phentsize <= 256 or phnum == 0:
                return f"busybox binary {path} is not a static ELF executable (no program)"
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except OSError as e:
        return f"read busybox binary {path}: {e.strerror}"
    if len(table) < phentsize * phnum:
        return f"busybox binary {path} is not a static ELF executable (truncated)"
    for i in range(phnum):
        if int.from_bytes(table[i * phentsize:i * phentsize + 4], order) == _ELF_PT_INTERP:
            return (f"busybox binary {path} is not a static ELF executable (it is "
                    "dynamically linked)")
    return None


def _pin_busybox(p: Pinner, roots: tuple[str, ...] | None, base_dir: str, binary: str) -> str:
    """The digest of a busybox binary, once it is known to be the host's package binary or a
    confined static ELF executable."""
    real = os.path.realpath(os.path.join(base_dir, binary))
    if roots is not None and real not in HOST_BUSYBOX:
        p.confined(roots, base_dir, binary)
    problem = static_elf_problem(real)
    if problem is not None:
        raise Unpinnable(problem, "name a static busybox (apt-get install busybox-static: "
                                   "/bin/busybox)")
    return p.path(base_dir, binary)


def _check_sha256(digest: str, declared: str | None, what: str,
                  hint: str = "update sha256 in the definition if the new file is intended"
                  ) -> None:
    if declared is None:
        return
    want = declared if declared.startswith("sha256:") else "sha256:" + declared
    if want.lower() != digest:
        raise Unpinnable(f"{what}: sha256 mismatch: declared {want}, file has {digest}", hint)


def _pin_one(d: LayerDefinition, p: Pinner, roots: tuple[str, ...] | None = None
             ) -> dict[str, str]:
    """The pins of one definition: {field: digest}. Raises (field, Unpinnable). With
    ``roots`` (``source_roots``), every path it names must resolve inside one of them
    (``confined_path``)."""
    base_dir = p.directory_of(d.origin.file)
    src = getattr(d, "source", None)
    pins: dict[str, str] = {}
    field = "from" if d.kind == "Base" else "source"

    def confine(rel: str) -> None:
        if roots is not None:
            p.confined(roots, base_dir, rel)

    try:
        if isinstance(src, (PathSource, ArchiveSource, RootfsSource)):
            confine(src.path)
            if isinstance(src, ArchiveSource) or (
                    isinstance(src, RootfsSource)
                    and not os.path.isdir(os.path.join(base_dir, src.path))):
                pins["source"] = p.by_sha256(base_dir, src.path, src.sha256, roots)
            else:
                pins["source"] = p.path(base_dir, src.path)
        elif isinstance(src, BusyboxSource):
            pins["source"] = _pin_busybox(p, roots, base_dir, src.binary)
        elif isinstance(src, GitSource):
            local = local_git_path(src.url, base_dir)
            if local is not None and git_source_problem(src.url, src.rev) is None:
                confine(local)
            pins["source"] = p.git(src.url, src.rev, base_dir)
        elif isinstance(src, OciSource):
            confine(src.layout)
            pins["source"] = p.oci(os.path.join(base_dir, src.layout), src.ref)
        elif isinstance(src, ImageSource):
            check_image_pinned(src)
        elif isinstance(src, DockerfileSource):  # issue 17
            pins.update(pin_dockerfile(src, base_dir, roots))
        for i, s in enumerate(d.steps):
            if isinstance(s, CopyStep):
                field = f"steps[{i}].copy.src"
                confine(s.src)
                pins[field] = p.path(base_dir, s.src)
    except Unpinnable as e:
        raise _Failed(field, e) from None
    return pins


class _Failed(Exception):
    def __init__(self, field: str, cause: Unpinnable) -> None:
        self.field, self.cause = field, cause


def pin_inputs(defs: DefinitionSet, pinner: Pinner | None = None) -> PinnedInputs:
    """Digests of everything ``defs`` read from outside the YAML; raise ``SourceError`` if not.

    Every definition is tried; all failures are reported together, each at its file:line.
    A task's hidden source is pinned as a workspace's source, under ``hidden``.
    """
    p = pinner or Pinner()
    roots = source_roots(defs.root, p.trusted)
    out: dict[str, MappingProxyType] = {}
    failures: list[tuple[str, str | None]] = []  # (message, hint)

    def failed(d, f: _Failed, field: str, paths: tuple[str, ...]) -> None:
        line, col = field_position(d.origin, *paths)
        where = f"{d.origin.file}:{line}:{col}" if line else d.origin.file
        failures.append((f"{where}: {d.name}: {f.cause.message} (at {field})", f.cause.hint))

    for d in defs.layers:
        try:
            pins = _pin_one(d, p, roots)
        except _Failed as f:
            failed(d, f, f.field, (f.field, f"{f.field}.path") if f.field in ("source", "from")
                   else (f.field,))
            continue
        if pins:
            out[d.name] = MappingProxyType(pins)
    for task in defs.tasks:
        try:
            out[task.name] = MappingProxyType(
                {HIDDEN_PIN: _pin_one(hidden_definition(task), p, roots)["source"]})
        except _Failed as f:
            failed(task, f, "hidden", ("hidden", "hidden.path"))
    if failures:
        failures.sort(key=lambda failure: failure[0])
        hints = [h for _, h in failures if h]
        if len(failures) == 1:
            raise SourceError(failures[0][0], hint=hints[0] if hints else None)
        raise SourceError(f"{len(failures)} sources cannot be pinned",
                          context="\n".join(m for m, _ in failures),
                          hint=hints[0] if len(hints) == 1 else None)
    return MappingProxyType(out)


# ---------------------------------------------------------------------- a whole tree, pinned


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One definition tree, loaded, checked, pinned and keyed: what plan/explain start from."""

    defs: DefinitionSet
    graph: EnvGraph
    pinned: PinnedInputs
    keys: KeySet


def snapshot(defs_dir: Path, pinner: Pinner | None = None,
             parse_cache: ParseCache | None = None) -> Snapshot:
    """Load ``defs_dir`` (files ``parse_cache`` knows are not re-parsed), build its graph, pin
    its sources and compute every key."""
    from envbuild.plan.graph import check_tree  # schema and graph problems in one report

    return snapshot_graph(check_tree(defs_dir, parse_cache), pinner, memo=parse_cache)


def snapshot_graph(graph: EnvGraph, pinner: Pinner | None = None,
                   previous: Previous | None = None, memo: KeyMemo | None = None) -> Snapshot:
    """``snapshot`` of a tree already loaded and checked; with ``previous`` (another tree's
    snapshot), keys of unchanged definitions are taken from it, with ``memo`` (the parse
    cache) keys computed in an earlier run from the same inputs (``compute_keys``)."""
    defs = graph.defs
    pinned = pin_inputs(defs, pinner)
    return Snapshot(defs=defs, graph=graph, pinned=pinned,
                    keys=compute_keys(graph, pinned, previous, memo))
