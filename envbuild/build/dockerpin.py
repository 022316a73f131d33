"""Pinning what a base reads from a registry or a Docker context: ``from: {image}`` and
Dockerfile bases (issue 17). Side effects: reads the context, may ask a registry for a tag.

The pins of a Dockerfile base are

- ``source``: the *context digest* (below) of the context directory, ``.dockerignore`` applied;
- ``source.dockerfile``: ``sha256:`` of the Dockerfile's bytes;
- ``source.from[i]``: the digest of the i-th image the Dockerfile reads (``FROM``, and the
  ``--from=`` of ``COPY``/``ADD``/``RUN --mount``: ``envbuild.defs.dockerfile.from_images``).

``args``, ``target`` and ``network`` are in the source's identity, so the layer key covers all
of them. A ``FROM`` must name its image by digest (``NAME[:TAG]@sha256:<hex>``): a tag can move,
so it is refused at planning with the digest it resolves to (asked of the registry when the
name has one; Docker Hub names cannot be asked offline). The same holds for ``from: {image}``.

**Context digest v1** — ``sha256:`` of ``b"envbuild.docker-context.v1\\0"`` and one record per
entry sent to the daemon, in the format of the tree digest v1 (``envbuild.build.pin``): the
root, then depth first, names sorted by bytes, ``TYPE\\0MODE\\0PATH\\0EXTRA\\0``. Unlike a tree
digest nothing is skipped but what ``.dockerignore`` excludes (``.git`` is sent to Docker unless
ignored). ``.dockerignore`` follows Docker's rules: one pattern a line, ``#`` comments, a
leading ``!`` re-includes, the last matching pattern wins, ``*``/``?``/``[...]`` within one
path component, ``**`` across any number, a pattern also matches everything below a directory it
matches. The walk is iterative, never follows a symlink (links are hashed and sent as links, so a
link out of the context copies a link, never the host file it names) and is bounded: at most
``ENVBUILD_DOCKER_CONTEXT_MAX_BYTES`` (default 16 GiB) of file bytes and
``ENVBUILD_DOCKER_CONTEXT_MAX_ENTRIES`` (default 1 000 000) entries, checked from ``stat``
before anything is read.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat

from envbuild.defs.confine import Unpinnable
from envbuild.defs.dockerfile import (
    ENV_PIN_PREFIX,
    ENV_REF_RE,
    LOCK_HOST,
    LOCK_REF_RE,
    from_images,
    locate,
    read_small,
)
from envbuild.defs.model import ImageSource
from envbuild.oci import DIGEST_PATTERN

CONTEXT_TAG = b"envbuild.docker-context.v1\0"
DEFAULT_MAX_BYTES = 16 << 30
DEFAULT_MAX_ENTRIES = 1_000_000
_DIGEST_RE = re.compile(f"@{DIGEST_PATTERN}$")


def env_limit(env: str, default: int) -> int:
    """The integer in ``$env``, else ``default`` (unset, empty or not a number)."""
    try:
        return int(os.environ.get(env, "") or default)
    except ValueError:
        return default


# ----------------------------------------------------------------------------- images


def check_image_pinned(src: ImageSource) -> None:
    """``from: {image}`` must name a digest: a tag is looked up (one manifest HEAD) only to
    say which digest to write."""
    host, repo, digest, tag = src.split()
    if digest is not None:
        return
    from envbuild.errors import EnvbuildError
    from envbuild.settings import Settings
    from envbuild.store.registry import RegistryStore

    try:
        store = RegistryStore(f"docker://{host}/{repo}",
                              insecure=Settings.from_env(os.environ).registry_insecure)
        resolved = store.get_ref(f"env/{tag or 'latest'}").digest
    except EnvbuildError as e:
        raise Unpinnable(f"image {src.ref} names no digest, and its tag cannot be resolved: "
                          f"{e.message}", f"write {host}/{repo}@sha256:<digest>") from None
    raise Unpinnable(f"image {src.ref} names a tag, not a digest: it resolves to {resolved} "
                      "now", f"write {host}/{repo}@{resolved} (a tag can move)")



def pin_from(ref: str) -> str:
    """The digest a ``FROM`` reference names; a tag is refused with the digest to write.
    An in-tree env (``envbuild.invalid/env/NAME``) pins as ``env/NAME``: the graph has
    checked that NAME is an Env of the tree, and the key covers its lock inputs."""
    m = ENV_REF_RE.fullmatch(ref)
    if m is not None:
        return ENV_PIN_PREFIX + m.group(1)
    if _DIGEST_RE.search(ref):
        if ref.startswith(LOCK_HOST + "/") and not LOCK_REF_RE.fullmatch(ref):
            raise Unpinnable(f"FROM {ref} is not {LOCK_HOST}/env/NAME@sha256:<lock digest>")
        return ref.rpartition("@")[2]
    name = ref.split("@", 1)[0]
    if name.startswith(LOCK_HOST + "/"):
        raise Unpinnable(f"FROM {ref} is not {LOCK_HOST}/env/NAME (an env of this tree) "
                         f"or {LOCK_HOST}/env/NAME@sha256:<lock digest>",
                         "name an Env of the definition tree, without a tag")
    first = name.split("/", 1)[0]
    if "/" in name and ("." in first or ":" in first or first == "localhost"):
        try:
            check_image_pinned(ImageSource(ref=name))
        except Unpinnable as e:
            raise Unpinnable(f"FROM {ref}: {e.message}", e.hint) from None
    raise Unpinnable(f"FROM {ref} names a tag, not a digest (a tag can move)",
                     f"pin it as {name}@sha256:<digest> (`skopeo inspect docker://{name}` or "
                     "`docker image inspect --format '{{.RepoDigests}}'` prints it)")



# ----------------------------------------------------------------------------- .dockerignore


def _pattern_regex(pattern: str) -> re.Pattern:
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                i += 2
                if pattern.startswith("/", i):
                    out.append("(?:.*/)?")
                    i += 1
                else:
                    out.append(".*")
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:j]
                if body.startswith("^") or body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = j
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


class DockerIgnore:
    """The patterns of a ``.dockerignore`` (see the module docstring for the rules)."""

    def __init__(self, text: str) -> None:
        self.rules: list[tuple[bool, re.Pattern, int]] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            if negate:
                line = line[1:].strip()
            line = os.path.normpath(line).lstrip("/")
            if line in ("", "."):
                continue
            self.rules.append((negate, _pattern_regex(line), line.count("/") + 1))
        self.has_negations = any(n for n, _r, _k in self.rules)

    def excluded(self, rel: str) -> bool:
        parts = rel.split("/")
        result = False
        for negate, rx, k in self.rules:
            if rx.match(rel) or (len(parts) > k and rx.match("/".join(parts[:k]))):
                result = not negate
        return result


# ----------------------------------------------------------------------------- context digest


def context_digest(root: str) -> str:
    """Context digest v1 of the directory ``root`` (module docstring)."""
    ignore = DockerIgnore(read_small(os.path.join(root, ".dockerignore"), missing_ok=True))
    h = hashlib.sha256(CONTEXT_TAG)
    h.update(b"d\0%o\0.\0\0" % stat.S_IMODE(os.stat(root).st_mode))
    # Two passes: first the whole listing (sizes from stat, so a huge context is refused before
    # a byte of it is read), then the file hashes in listing order.
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    for head, tail, fpath in _context_records(root, ignore):
        h.update(head)
        if fpath is not None:
            fh = hashlib.sha256()
            try:
                fd = os.open(fpath, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with open(fd, "rb", buffering=0) as f:
                    while n := f.readinto(buf):
                        fh.update(view[:n])
            except OSError as e:
                raise Unpinnable(f"read {fpath}: {e.strerror}") from None
            h.update(fh.hexdigest().encode() + (tail or b""))
    return "sha256:" + h.hexdigest()


def _context_records(root: str, ignore: DockerIgnore
                     ) -> list[tuple[bytes, bytes | None, str | None]]:
    """The records of the entries sent to the daemon, depth first, names sorted by bytes:
    (record, or for a file its head, the tail after the file's sha256, the file to hash).
    Bounded by ``ENVBUILD_DOCKER_CONTEXT_MAX_BYTES`` / ``_MAX_ENTRIES``, from ``stat``."""
    max_bytes = env_limit("ENVBUILD_DOCKER_CONTEXT_MAX_BYTES", DEFAULT_MAX_BYTES)
    max_entries = env_limit("ENVBUILD_DOCKER_CONTEXT_MAX_ENTRIES", DEFAULT_MAX_ENTRIES)
    total = entries = 0
    todo: list[tuple[str, bytes]] = [(root, b"")]
    records: list[tuple[bytes, bytes | None, str | None]] = []
    while todo:
        dirpath, rel = todo.pop()
        try:
            with os.scandir(dirpath) as it:
                listing = sorted(it, key=lambda e: os.fsencode(e.name))
        except OSError as e:
            raise Unpinnable(f"list {dirpath}: {e.strerror}") from None
        subdirs = []
        for ent in listing:
            path = rel + os.fsencode(ent.name)
            srel = os.fsdecode(path)
            st = ent.stat(follow_symlinks=False)
            mode = st.st_mode
            if ignore.excluded(srel) and not (stat.S_ISDIR(mode) and ignore.has_negations):
                continue
            entries += 1
            if entries > max_entries:
                raise Unpinnable(f"docker context {root} has more than {max_entries} entries",
                                 "exclude what the build does not need in .dockerignore "
                                 "(or raise ENVBUILD_DOCKER_CONTEXT_MAX_ENTRIES)")
            if stat.S_ISDIR(mode):
                records.append((b"d\0%o\0%b\0\0" % (stat.S_IMODE(mode), path), None, None))
                subdirs.append((ent.path, path + b"/"))
            elif stat.S_ISREG(mode):
                if ignore.excluded(srel):
                    continue
                total += st.st_size
                if total > max_bytes:
                    raise Unpinnable(f"docker context {root} holds more than {max_bytes >> 20} "
                                     "MiB of files",
                                     "exclude what the build does not need in .dockerignore "
                                     "(or raise ENVBUILD_DOCKER_CONTEXT_MAX_BYTES)")
                records.append((b"f\0%o\0%b\0%d:" % (stat.S_IMODE(mode), path, st.st_size),
                                b"\0", ent.path))
            elif stat.S_ISLNK(mode):
                records.append((b"l\x000\0%b\0%b\0" % (path, os.fsencode(os.readlink(ent.path))),
                                None, None))
            else:
                kind = (b"p" if stat.S_ISFIFO(mode) else b"s" if stat.S_ISSOCK(mode)
                        else b"c" if stat.S_ISCHR(mode) else b"b")
                records.append((b"%b\0%o\0%b\0\0" % (kind, stat.S_IMODE(mode), path), None, None))
        todo.extend(reversed(subdirs))
    return records


# ----------------------------------------------------------------------------- pinning


def pin_dockerfile(src, base_dir: str, roots: tuple[str, ...] | None = None) -> dict[str, str]:
    """The pins of a Dockerfile base (module docstring); raises ``Unpinnable``."""
    context, dockerfile = locate(src, base_dir, roots)
    try:
        text = read_small(dockerfile)
    except FileNotFoundError:
        raise Unpinnable(f"Dockerfile {src.file} not found in the context {src.context}",
                         "set from.dockerfile.file (relative to the context)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Unpinnable(f"Dockerfile {src.file} is a symlink, refused",
                             "point file: at the Dockerfile itself") from None
        raise Unpinnable(f"read Dockerfile {src.file}: {e.strerror}") from None
    pins = {"source": context_digest(context),
            "source.dockerfile": "sha256:" + hashlib.sha256(text.encode()).hexdigest()}
    for i, ref in enumerate(from_images(text, dict(src.args))):
        pins[f"source.from[{i}]"] = pin_from(ref)
    return pins
