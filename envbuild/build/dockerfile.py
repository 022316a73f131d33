"""Dockerfile bases: ``from: {dockerfile: {context, file, args, target, network}}`` (issue 17).

Two halves, as for every source:

**Pinning** (``pin_dockerfile``, no daemon): the pins of a Dockerfile base are

- ``source``: the *context digest* (below) of the context directory, ``.dockerignore`` applied;
- ``source.dockerfile``: ``sha256:`` of the Dockerfile's bytes;
- ``source.from[i]``: the digest of the i-th image the Dockerfile reads: ``FROM``, and the
  ``--from=`` of ``COPY``/``ADD``/``RUN --mount`` (``scratch`` and earlier stages are not
  images). ``ADD`` of a URL is refused: the daemon would fetch it on the host's network,
  outside ``network: none`` and outside the key.

``args``, ``target`` and ``network`` are in the source's identity, so the layer key covers all
of them. A ``FROM`` must name its image by digest (``NAME[:TAG]@sha256:<hex>``): a tag can move,
so it is refused at planning with the digest it resolves to (asked of the registry when the
name has one; Docker Hub names cannot be asked offline). ``FROM`` lines are read as Docker reads
them: ``# escape=`` directive, line continuations, comments, ``--platform=`` flags, ``AS name``,
and ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` / ``${VAR:+alt}`` of the ``ARG``\\ s declared
before the first ``FROM`` (the definition's ``args`` override their defaults).

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

The context directory and the Dockerfile must lie inside the source root (as ``path`` sources);
the Dockerfile is read without following a final symlink.

**Building** (``build_dockerfile``, side effects): the Dockerfile bytes are read again and must
still hash to their pin; they are written to the build's scratch dir and given to
``docker build`` (``DOCKER_BUILDKIT=1``, ``--progress=plain``, ``--network``, ``--build-arg``\\ s,
``--target``, ``--iidfile``; with ``network: host`` the host's CA bundle as the secret
``envbuild-host-ca``) with the context directory, against ``envbuild.dockerd``'s daemon
(a private dockerd under the node cache, stopped and removed when the build ends, or the user's
at ``DOCKER_HOST``). Debian's dockerd 20.10 has no ``oci`` exporter (``exporter "oci" could not
be found``), so the image leaves the daemon by ``docker save`` into the scratch dir (the layer's
capped disk). Its ``manifest.json`` and config are read bounded, each layer's sha256 is checked
against the config's ``rootfs.diff_ids`` while it streams through the one safe unpacker
(``envbuild.layers._unpack.unpack_tar``, whiteouts applied, as for ``oci`` bases), and the
config's ``Env``/``WorkingDir``/``User``/``Cmd`` are kept. A failing build raises
``BuildError`` with its last output line as the cause and the output tail as context.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import signal
import stat
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from envbuild.errors import BuildError, SourceError

CONTEXT_TAG = b"envbuild.docker-context.v1\0"
DEFAULT_MAX_BYTES = 16 << 30
DEFAULT_MAX_ENTRIES = 1_000_000
MAX_DOCKERFILE_BYTES = 4 << 20
OUTPUT_TAIL_LINES = 30
DEFAULT_BUILD_TIMEOUT = 3 * 3600
_DIGEST_RE = re.compile(r"@sha256:[0-9a-f]{64}$")
_ARG_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


class Unpinnable(Exception):
    """A Dockerfile base that cannot be pinned (turned into a SourceError at its line)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message, self.hint = message, hint


# ----------------------------------------------------------------------------- FROM lines


def logical_lines(text: str) -> list[str]:
    """The instructions of a Dockerfile: continuations joined, comments and blanks dropped."""
    escape = "\\"
    lines = text.splitlines()
    for line in lines:  # parser directives: only at the top, before anything else
        m = re.fullmatch(r"\s*#\s*(\w+)\s*=\s*(\S*)\s*", line)
        if not m:
            break
        if m.group(1).lower() == "escape" and m.group(2) in ("\\", "`"):
            escape = m.group(2)
    out: list[str] = []
    cur = ""
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and cur):
            continue  # comments (and blank lines) inside a continuation do not end it
        if stripped.endswith(escape):
            cur += stripped[:-1]
            continue
        cur += stripped
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    if cur.strip():
        out.append(cur.strip())
    return out


def _expand(word: str, values: Mapping[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        op, arg = m.group(3), m.group(4) or ""
        val = values.get(name)
        if op == ":-":
            return val if val else arg
        if op == ":+":
            return arg if val else ""
        return val or ""

    return re.sub(rf"\$(?:({_ARG_NAME})|\{{({_ARG_NAME})(?:(:[-+])([^}}]*))?\}})", sub, word)


def from_images(text: str, args: Mapping[str, str]) -> list[str]:
    """The image references of a Dockerfile, in order, ``ARG``\\ s expanded: ``FROM`` lines and
    the ``--from=`` of ``COPY``/``ADD`` and ``RUN --mount`` (another way to read an image);
    ``scratch`` and earlier stages (by name or index) left out. ``ADD`` of a URL and a
    ``# syntax=`` directive (a frontend image the daemon would pull) are refused."""
    for line in text.splitlines():  # parser directives: only at the top, before anything else
        m = re.fullmatch(r"\s*#\s*(\w+)\s*=\s*(\S*)\s*", line)
        if not m:
            break
        if m.group(1).lower() == "syntax":
            raise Unpinnable(f"'# syntax={m.group(2)}' makes the daemon pull a BuildKit frontend "
                             "image from a registry, outside the key and outside network: none",
                             "remove the line: the daemon's built-in Dockerfile frontend is used")
    declared: dict[str, str] = {}
    stages: set[str] = set()
    images: list[str] = []
    seen_from = False
    for line in logical_lines(text):
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "ARG" and not seen_from:
            for item in rest.split():
                name, eq, default = item.partition("=")
                if re.fullmatch(_ARG_NAME, name):
                    declared[name] = args.get(name, default.strip("\"'") if eq else "")
        elif instr == "FROM":
            seen_from = True
            words = [w for w in rest.split() if not w.startswith("--")]
            if not words:
                raise Unpinnable(f"FROM without an image: {line!r}")
            ref = _expand(words[0], declared)
            if "$" in ref or not ref:
                raise Unpinnable(f"FROM {words[0]} does not expand to an image name",
                                 "declare the ARG before the first FROM, with a default or "
                                 "in the definition's args")
            if ref.lower() != "scratch" and ref.lower() not in stages:
                images.append(ref)
            if len(words) >= 3 and words[1].lower() == "as":
                stages.add(words[2].lower())
        elif instr in ("COPY", "ADD", "RUN"):
            if instr == "ADD" and _URL_RE.search(rest):
                raise Unpinnable(f"ADD of a URL is a download the key cannot cover, made by the "
                                 f"daemon outside network: none ({line[:80]!r})",
                                 "put the file in the context, or fetch it in a RUN step with "
                                 "network: host")
            for word in rest.split():
                if not word.startswith("--"):
                    break
                for value in _from_flags(word):
                    ref = _expand(value, declared)
                    if ref.lower() not in stages and not ref.isdigit() and ref.lower() != "scratch":
                        images.append(ref)
    return images


# ADD's remote sources: fetched by the daemon itself, with the host's network
_URL_RE = re.compile(r"(?:^|[\s\"\[,])(?:[A-Za-z][A-Za-z0-9+.-]*://|git@)")


def _from_flags(word: str) -> list[str]:
    """The image/stage names a ``COPY``/``ADD --from=X`` or ``RUN --mount=...,from=X`` names."""
    if word.startswith("--from="):
        return [word[len("--from="):]]
    if word.startswith("--mount="):
        return [kv[len("from="):] for kv in word[len("--mount="):].split(",")
                if kv.startswith("from=")]
    return []


#: the BuildKit secret id of the host's CA bundle, given to ``network: host`` builds: the host
#: may reach PyPI & co. only through an intercepting proxy that bundle trusts (envbuild's own
#: network steps get it bound in); a RUN takes it with
#: ``--mount=type=secret,id=envbuild-host-ca,target=/etc/ssl/certs/ca-certificates.crt``
HOST_CA_SECRET = "envbuild-host-ca"

#: ``FROM envbuild.invalid/env/NAME@sha256:<lock digest>`` names an env lock of the envbuild
#: store (``.invalid`` never resolves: no registry is ever asked for it).
LOCK_HOST = "envbuild.invalid"
_LOCK_REF_RE = re.compile(rf"{re.escape(LOCK_HOST)}/(env/[a-z0-9][a-z0-9._-]*)@(sha256:[0-9a-f]{{64}})")
#: ``FROM envbuild.invalid/env/NAME`` without a digest: the Env NAME of the same definition
#: tree, an edge of the graph (built and locked first; its lock inputs are in the key).
_ENV_REF_RE = re.compile(rf"{re.escape(LOCK_HOST)}/env/([a-z0-9][a-z0-9._-]*)")
#: the pin of such a FROM: a name, not a digest (the key gets the env's lock inputs instead)
ENV_PIN_PREFIX = "env/"


def env_upstreams(dockerfile: str, args: Mapping[str, str]) -> tuple[str, ...]:
    """The env names of the ``FROM envbuild.invalid/env/NAME`` (no digest) references of the
    Dockerfile at ``dockerfile``, in order, once each (raises ``Unpinnable``/``OSError``)."""
    refs = from_images(_read_small(dockerfile), args)
    return tuple(dict.fromkeys(m.group(1) for r in refs if (m := _ENV_REF_RE.fullmatch(r))))


def pin_from(ref: str) -> str:
    """The digest a ``FROM`` reference names; a tag is refused with the digest to write.
    An in-tree env (``envbuild.invalid/env/NAME``) pins as ``env/NAME``: the graph has
    checked that NAME is an Env of the tree, and the key covers its lock inputs."""
    m = _ENV_REF_RE.fullmatch(ref)
    if m is not None:
        return ENV_PIN_PREFIX + m.group(1)
    if _DIGEST_RE.search(ref):
        if ref.startswith(LOCK_HOST + "/") and not _LOCK_REF_RE.fullmatch(ref):
            raise Unpinnable(f"FROM {ref} is not {LOCK_HOST}/env/NAME@sha256:<lock digest>")
        return ref.rpartition("@")[2]
    name = ref.split("@", 1)[0]
    if name.startswith(LOCK_HOST + "/"):
        raise Unpinnable(f"FROM {ref} is not {LOCK_HOST}/env/NAME (an env of this tree) "
                         f"or {LOCK_HOST}/env/NAME@sha256:<lock digest>",
                         "name an Env of the definition tree, without a tag")
    first = name.split("/", 1)[0]
    if "/" in name and ("." in first or ":" in first or first == "localhost"):
        from envbuild.build.pin import _check_image_pinned, _Unpinnable
        from envbuild.defs.model import ImageSource

        try:
            _check_image_pinned(ImageSource(ref=name))
        except _Unpinnable as e:
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


def _limit(env: str, default: int) -> int:
    try:
        return int(os.environ.get(env, "") or default)
    except ValueError:
        return default


def context_digest(root: str) -> str:
    """Context digest v1 of the directory ``root`` (module docstring)."""
    max_bytes = _limit("ENVBUILD_DOCKER_CONTEXT_MAX_BYTES", DEFAULT_MAX_BYTES)
    max_entries = _limit("ENVBUILD_DOCKER_CONTEXT_MAX_ENTRIES", DEFAULT_MAX_ENTRIES)
    ignore = DockerIgnore(_read_small(os.path.join(root, ".dockerignore"), missing_ok=True))
    h = hashlib.sha256(CONTEXT_TAG)
    h.update(b"d\0%o\0.\0\0" % stat.S_IMODE(os.stat(root).st_mode))
    total = entries = 0
    todo: list[tuple[str, bytes]] = [(root, b"")]
    records: list[tuple[bytes, bytes | None, str | None]] = []
    # Two passes: first the whole listing (sizes from stat, so a huge context is refused before
    # a byte of it is read), then the file hashes in listing order.
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
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    for head, tail, fpath in records:
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


def _read_small(path: str, *, missing_ok: bool = False, limit: int = MAX_DOCKERFILE_BYTES) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if missing_ok:
            return ""
        raise
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise Unpinnable(f"{path} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise Unpinnable(f"{path} is larger than {limit >> 20} MiB")
    try:  # strict: the bytes hashed are the bytes docker reads
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Unpinnable(f"{os.path.basename(path)} is not UTF-8 text (byte {e.start})") from None


# ----------------------------------------------------------------------------- pinning


def locate(src, base_dir: str, roots: tuple[str, ...] | None) -> tuple[str, str]:
    """``(context dir, Dockerfile path)``, both checked inside ``roots`` when given
    (``envbuild.build.pin.source_roots``)."""
    from envbuild.build.pin import _Unpinnable, confined_path

    context = os.path.join(base_dir, src.context)
    if not os.path.isdir(context):
        raise Unpinnable(f"docker context {src.context} is not a directory",
                         f"it is resolved against {base_dir or '.'}/")
    try:
        if roots is not None:
            context = confined_path(roots, base_dir, src.context)
        dockerfile = os.path.join(context, src.file)
        # The Dockerfile's directory may be reached through links inside the source root; the
        # file itself is opened without following a final symlink.
        parent = os.path.dirname(dockerfile)
        if roots is not None:
            confined_path(roots, context, os.path.dirname(src.file) or ".")
    except _Unpinnable as e:
        raise Unpinnable(e.message, e.hint) from None
    dockerfile = os.path.join(os.path.realpath(parent), os.path.basename(dockerfile))
    return os.path.realpath(context), dockerfile


def pin_dockerfile(src, base_dir: str, roots: tuple[str, ...] | None = None) -> dict[str, str]:
    """The pins of a Dockerfile base (module docstring); raises ``Unpinnable``."""
    context, dockerfile = locate(src, base_dir, roots)
    try:
        text = _read_small(dockerfile)
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


# ----------------------------------------------------------------------------- building


def build_dockerfile(src, name: str, base_dir: Path, pins: Mapping[str, str], dest: Path,
                     scratch: Path, daemon_root: Path, log: Path,
                     cancelled: threading.Event | None = None, store=None):
    """Build the Dockerfile base ``src`` and unpack its image into ``dest``; returns the
    image's config as ``importers.Imported``."""
    from envbuild.build.importers import _run
    from envbuild.dockerd import docker_daemon

    try:
        context, dockerfile = locate(src, str(base_dir), None)
        text = _read_small(dockerfile)
    except (Unpinnable, OSError) as e:
        raise SourceError(f"{name}: {getattr(e, 'message', None) or e}") from None
    digest = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    if pins.get("source.dockerfile") not in (None, digest):
        raise SourceError(f"{name}: {src.file} changed since it was planned",
                          hint="run the build again (it re-plans)")
    scratch.mkdir(parents=True, exist_ok=True)
    locks = _lock_archives(text, src, name, store, scratch)
    locks += _prefetch(text, src, name, scratch, daemon_root, len(locks), cancelled)
    for i, (ref, _archive) in enumerate(locks):
        # whole references only: envbuild.invalid/env/a is a prefix of .../env/a@sha256:… and
        # of .../env/ab
        tag = _lock_tag(scratch, i)
        text = re.sub(re.escape(ref) + r"(?![A-Za-z0-9._@:/-])", tag, text)  # no backslash in a tag
    (scratch / "Dockerfile").write_text(text)
    iid, image = scratch / "iid", scratch / "image.tar"
    t0 = time.monotonic()
    # network: host means egress, not the host (as for envbuild's own run steps): a private
    # daemon runs in a namespace of its own behind slirp4netns for it
    # Its data root (images, BuildKit's cache, what RUN steps write) is on the layer's capped
    # scratch disk, as the rest of the build's writes: a RUN step meets ENOSPC at the cap.
    with docker_daemon(daemon_root, egress_only=src.network == "host",
                       data_root=scratch / "daemon-data") as d:
        _note(log, f"daemon ready in {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        for i, (ref, archive) in enumerate(locks):
            _load_lock(d, ref, archive, _lock_tag(scratch, i), cancelled)
        argv = [d.cli, "build", "--progress=plain", f"--network={src.network}",
                "--iidfile", str(iid), "-f", str(scratch / "Dockerfile")]
        if src.network == "host":
            from runtime_shim.isolation.stub import host_ca_bundle

            ca = host_ca_bundle()
            if ca is not None:  # a secret: never in the image, never in the build cache key
                argv += ["--secret", f"id={HOST_CA_SECRET},src={ca}"]
        for k, v in src.args:
            argv += ["--build-arg", f"{k}={v}"]
        if src.target:
            argv += ["--target", src.target]
        argv += ["--", context]
        _note(log, f"{name}: docker build ({'private dockerd' if d.private else d.host})")
        limit = _limit("ENVBUILD_DOCKER_BUILD_TIMEOUT", DEFAULT_BUILD_TIMEOUT)
        stop = _deadline(cancelled, limit)
        try:
            code = _run_logged(argv, d.env(), log, stop)
        finally:
            stop.set()  # ends the watcher
        if code is None:
            if cancelled is not None and cancelled.is_set():
                raise BuildError(f"{name}: cancelled", hint="nothing was published for this layer")
            raise BuildError(f"{name}: docker build timed out after {limit} s",
                             context=_build_failed(name, log).context,
                             hint="raise ENVBUILD_DOCKER_BUILD_TIMEOUT if the build is meant to "
                                  "take that long")
        if code != 0:
            raise _build_failed(name, log)
        t1 = time.monotonic()
        _note(log, f"docker build took {t1 - t0:.1f} s")
        image_id = iid.read_text().strip()
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", image_id):
            raise BuildError(f"{name}: docker build wrote no image id ({image_id[:80]!r})")
        try:
            _run([d.cli, "save", "-o", str(image), "--", image_id], "docker save",
                 cancelled=cancelled, env=d.env())
        finally:
            if not d.private:  # leave no image behind in the user's daemon (its cache stays)
                for ref in [image_id] + [_lock_tag(scratch, i) for i in range(len(locks))]:
                    subprocess.run([d.cli, "image", "rm", "--", ref], env=d.env(),
                                   capture_output=True, stdin=subprocess.DEVNULL, timeout=60,
                                   check=False)
        t2 = time.monotonic()
        _note(log, f"docker save took {t2 - t1:.1f} s")
    t3 = time.monotonic()
    _note(log, f"daemon stopped and removed in {t3 - t2:.1f} s")
    imported = import_docker_archive(image, dest, f"{name}: image")
    _note(log, f"image unpacked in {time.monotonic() - t3:.1f} s")
    return imported


def _note(log: Path, text: str) -> None:
    with open(log, "ab") as out:
        out.write(f"=== {text}\n".encode())


def _run_logged(argv: list[str], env: Mapping[str, str], log: Path,
                stop: threading.Event) -> int | None:
    """Run ``argv`` with its output appended to ``log``, which keeps its head and tail past
    ``BUILD_LOG_CAP`` (a build's output is untrusted and the log is on the host, outside any
    capped disk). Returns the exit code, or None when ``stop`` was set first (its process
    group killed)."""
    from envbuild.build.buildlog import CappedLog
    from envbuild.build.executor import BUILD_LOG_CAP
    from runtime_shim.isolation.scratchfs import copy_capped

    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=write_fd,
                                stderr=write_fd, env=dict(env), start_new_session=True)
    except OSError as e:
        os.close(read_fd)
        raise BuildError(f"run {argv[0]}: {e.strerror or e}",
                         hint="apt-get install docker.io (scripts/setup.sh)") from None
    finally:
        os.close(write_fd)
    copier = threading.Thread(target=copy_capped,
                              args=(read_fd, CappedLog(log, BUILD_LOG_CAP), sys.maxsize),
                              daemon=True)
    copier.start()
    try:
        while True:
            try:
                return proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                if stop.is_set():
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return None
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        copier.join(timeout=30)


def _deadline(cancelled: threading.Event | None, seconds: int) -> threading.Event:
    """An event set when ``cancelled`` is (Ctrl-C of the build) or ``seconds`` have passed."""
    ev = threading.Event()

    def watch() -> None:
        end = time.monotonic() + seconds
        while not ev.is_set():
            if (cancelled is not None and cancelled.is_set()) or time.monotonic() > end:
                ev.set()
                return
            ev.wait(0.1)

    threading.Thread(target=watch, daemon=True).start()
    return ev


def _lock_tag(scratch: Path, i: int) -> str:
    # unique per build: two builds sharing a user's daemon never see each other's tags
    return f"envbuild-from/{hashlib.sha256(str(scratch).encode()).hexdigest()[:12]}:{i}"


def _lock_archives(text: str, src, name: str, store, scratch: Path) -> list[tuple[str, Path]]:
    """``(reference, docker-archive)`` of every ``FROM envbuild.invalid/env/NAME@DIGEST``: the
    lock exported from the store (plain tar layers), checked to be the pinned digest."""
    from envbuild.export import ExportRequest, ExportTarget, export_lock

    out: list[tuple[str, Path]] = []
    for ref in dict.fromkeys(from_images(text, dict(src.args))):
        m = _LOCK_REF_RE.fullmatch(ref)
        env = _ENV_REF_RE.fullmatch(ref)
        if m is None and env is None:
            continue
        if ref not in text:
            raise SourceError(f"{name}: FROM {ref} must be written literally (not built from "
                              "ARGs) to be served from the envbuild store")
        if store is None:
            raise BuildError(f"{name}: FROM {ref} needs the envbuild store")
        from envbuild.errors import RefNotFound

        lock_ref = m.group(1) if m is not None else f"env/{env.group(1)}"  # type: ignore[union-attr]
        try:
            now = store.get_ref(lock_ref).digest
        except RefNotFound:
            raise SourceError(f"{name}: FROM {ref}: the store has no lock {lock_ref}",
                              hint=f"build it first: envbuild build {lock_ref[4:]}") from None
        # an in-tree env (no digest) is whatever it is locked at now: the engine locks it just
        # before this build, from the layers this plan keyed (``engine.build``)
        digest = m.group(2) if m is not None else now
        if now != digest:
            raise SourceError(f"{name}: FROM {ref}: {lock_ref} is locked at {now}, not {digest}",
                              hint=f"write {LOCK_HOST}/{lock_ref}@{now} to build on the "
                                   "current lock")
        archive = scratch / f"from-{len(out)}.tar"
        export_lock(store, ExportRequest(ref=lock_ref, target=ExportTarget(
            "docker-archive", archive, _lock_tag(scratch, len(out))), compression="none"))
        out.append((ref, archive))
    return out


def _prefetch(text: str, src, name: str, scratch: Path, daemon_root: Path, first: int,
              cancelled) -> list[tuple[str, Path]]:
    """``network: host`` puts the private daemon behind slirp4netns, where the host's
    loopback (a local registry) is out of reach: the ``FROM`` images of registries are pulled
    first by a daemon in the host's namespace (that daemon runs no build step) and saved,
    then loaded into the build's daemon like locks. Nothing to do for ``network: none`` or
    with ``DOCKER_HOST``."""
    from envbuild.build.importers import _run
    from envbuild.dockerd import docker_daemon

    if src.network != "host" or os.environ.get("DOCKER_HOST", "").strip():
        return []
    refs = [r for r in dict.fromkeys(from_images(text, dict(src.args)))
            if not _LOCK_REF_RE.fullmatch(r) and not _ENV_REF_RE.fullmatch(r)]
    if not refs:
        return []
    for ref in refs:
        if ref not in text:
            raise SourceError(f"{name}: FROM {ref} must be written literally (not built from "
                              "ARGs) with network: host")
    out: list[tuple[str, Path]] = []
    with docker_daemon(daemon_root, data_root=scratch / "prefetch-data") as pre:
        for ref in refs:
            tag = _lock_tag(scratch, first + len(out))
            archive = scratch / f"from-{first + len(out)}.tar"
            for argv in (["pull", "-q", "--", ref], ["tag", "--", ref, tag],
                         ["save", "-o", str(archive), "--", tag]):
                _run([pre.cli, *argv], f"docker {argv[0]} of {ref}", cancelled=cancelled,
                     env=pre.env())
            out.append((ref, archive))
    return out


def _load_lock(d, ref: str, archive: Path, tag: str, cancelled) -> None:
    from envbuild.build.importers import _run

    _run([d.cli, "load", "-q", "-i", str(archive)], f"docker load of {ref}",
         cancelled=cancelled, env=d.env())


def _build_failed(name: str, log: Path) -> BuildError:
    with open(log, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 256 * 1024))
        lines = f.read().decode(errors="replace").splitlines()
    tail = lines[-OUTPUT_TAIL_LINES:]
    cause = next((ln.strip() for ln in reversed(lines) if ln.strip()), "no output")
    cause = re.sub(r"^#\d+ (\d+\.\d+ )?", "", cause)
    if len(cause) > 300:
        cause = cause[:300] + "…"
    return BuildError(f"{name}: docker build failed: {cause}", context="\n".join(tail),
                      hint=f"full log: {log}; nothing was published")


class _Hashing:
    """A reader that hashes what passes through it."""

    def __init__(self, f) -> None:
        self.f, self.h = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.h.update(data)
        return data

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.h.update(memoryview(b)[:n])
        return n


def import_docker_archive(path: Path, dest: Path, what: str):
    """Unpack the single image of a ``docker save`` archive into ``dest`` (layers checked
    against the config's diff_ids); returns its config as ``importers.Imported``."""
    from envbuild.build.importers import Imported
    from envbuild.canonical import load_json
    from envbuild.layers._unpack import unpack_tar

    def member_json(tar: tarfile.TarFile, member: str):
        try:
            f = tar.extractfile(member)
        except KeyError:
            f = None
        if f is None:
            raise BuildError(f"{what}: {member} is missing from the saved image")
        data = f.read((4 << 20) + 1)
        try:
            return load_json(data, max_bytes=4 << 20)
        except ValueError as e:
            raise BuildError(f"{what}: {member} is not valid JSON ({e})") from None

    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "r:") as tar:
        manifest = member_json(tar, "manifest.json")
        if not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0], dict):
            raise BuildError(f"{what}: manifest.json does not describe one image")
        config_doc = member_json(tar, str(manifest[0].get("Config")))
        layers = manifest[0].get("Layers") or []
        diff_ids = (config_doc.get("rootfs") or {}).get("diff_ids") or []
        if len(diff_ids) != len(layers):
            raise BuildError(f"{what}: {len(layers)} layers but {len(diff_ids)} diff_ids")
        for member, diff_id in zip(layers, diff_ids):
            f = tar.extractfile(str(member)) if member in tar.getnames() else None
            if f is None:
                raise BuildError(f"{what}: layer {member} is missing from the saved image")
            reader = _Hashing(f)
            unpack_tar(reader, dest, name=f"{what} layer {str(diff_id)[:19]}", whiteouts="apply")
            while reader.read(1 << 20):
                pass
            if "sha256:" + reader.h.hexdigest() != diff_id:
                raise BuildError(f"{what}: layer {member} does not hash to its diff_id {diff_id}")
    config = config_doc.get("config") or {}
    env = dict(str(item).partition("=")[::2] for item in config.get("Env") or [])
    cmd = config.get("Cmd")
    return Imported(env=env, workdir=config.get("WorkingDir") or None,
                    user=config.get("User") or None, cmd=tuple(cmd) if cmd else None)
