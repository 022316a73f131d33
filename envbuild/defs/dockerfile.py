"""The Dockerfile a Dockerfile base names (``from: {dockerfile: {context, file, args}}``):
located inside the source root, read bounded, and its image references parsed.

This is what a definition *says* through its Dockerfile, shared by the loader (the in-tree
envs a ``FROM envbuild.invalid/env/NAME`` line names are edges of the graph:
``DockerfileSource.envs``) and by pinning and building (``envbuild.build.dockerpin``,
``envbuild.build.dockerfile``). Nothing here runs a daemon or hashes a context.

``FROM`` lines are read as Docker reads them: ``# escape=`` directive, line continuations,
comments, ``--platform=`` flags, ``AS name``, and ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` /
``${VAR:+alt}`` of the ``ARG``\\ s declared before the first ``FROM`` (the definition's ``args``
override their defaults). The image references of a Dockerfile are its ``FROM`` images and the
``--from=`` of ``COPY``/``ADD``/``RUN --mount`` (``scratch`` and earlier stages are not images).
``ADD`` of a URL and a ``# syntax=`` directive are refused: the daemon would fetch them on the
host's network, outside ``network: none`` and outside the key.

The context directory and the Dockerfile must lie inside the source root (as ``path`` sources,
``envbuild.defs.confine``); the Dockerfile is read without following a final symlink, at most
``MAX_DOCKERFILE_BYTES``, strictly as UTF-8.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping

from envbuild.defs.confine import Unpinnable, confined_path
from envbuild.oci import DIGEST_PATTERN

MAX_DOCKERFILE_BYTES = 4 << 20
_ARG_NAME = r"[A-Za-z_][A-Za-z0-9_]*"

__all__ = ["ENV_PIN_PREFIX", "ENV_REF_RE", "LOCK_HOST", "LOCK_REF_RE", "MAX_DOCKERFILE_BYTES",
           "Unpinnable", "env_upstreams", "from_images", "locate", "logical_lines", "read_small"]

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
    _refuse_syntax_directive(text)
    declared: dict[str, str] = {}
    stages: set[str] = set()
    images: list[str] = []
    seen_from = False
    for line in logical_lines(text):
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "ARG" and not seen_from:
            _declare_args(rest, args, declared)
        elif instr == "FROM":
            seen_from = True
            images += _from_line(line, rest, declared, stages)
        elif instr in ("COPY", "ADD", "RUN"):
            images += _from_flags_of(instr, line, rest, declared, stages)
    return images


def _refuse_syntax_directive(text: str) -> None:
    for line in text.splitlines():  # parser directives: only at the top, before anything else
        m = re.fullmatch(r"\s*#\s*(\w+)\s*=\s*(\S*)\s*", line)
        if not m:
            break
        if m.group(1).lower() == "syntax":
            raise Unpinnable(f"'# syntax={m.group(2)}' makes the daemon pull a BuildKit frontend "
                             "image from a registry, outside the key and outside network: none",
                             "remove the line: the daemon's built-in Dockerfile frontend is used")


def _declare_args(rest: str, args: Mapping[str, str], declared: dict[str, str]) -> None:
    """An ``ARG`` before the first ``FROM``: its names, with the definition's values."""
    for item in rest.split():
        name, eq, default = item.partition("=")
        if re.fullmatch(_ARG_NAME, name):
            declared[name] = args.get(name, default.strip("\"'") if eq else "")


def _from_line(line: str, rest: str, declared: Mapping[str, str], stages: set[str]) -> list[str]:
    """The image a ``FROM`` line reads (none for ``scratch`` or an earlier stage); records its
    stage name."""
    words = [w for w in rest.split() if not w.startswith("--")]
    if not words:
        raise Unpinnable(f"FROM without an image: {line!r}")
    ref = _expand(words[0], declared)
    if "$" in ref or not ref:
        raise Unpinnable(f"FROM {words[0]} does not expand to an image name",
                         "declare the ARG before the first FROM, with a default or "
                         "in the definition's args")
    found = [ref] if ref.lower() != "scratch" and ref.lower() not in stages else []
    if len(words) >= 3 and words[1].lower() == "as":
        stages.add(words[2].lower())
    return found


def _from_flags_of(instr: str, line: str, rest: str, declared: Mapping[str, str],
                   stages: set[str]) -> list[str]:
    """The images a ``COPY``/``ADD``/``RUN`` reads with ``--from=`` (or a mount's ``from=``);
    ``ADD`` of a URL is refused."""
    if instr == "ADD" and _URL_RE.search(rest):
        raise Unpinnable(f"ADD of a URL is a download the key cannot cover, made by the "
                         f"daemon outside network: none ({line[:80]!r})",
                         "put the file in the context, or fetch it in a RUN step with "
                         "network: host")
    found = []
    for word in rest.split():
        if not word.startswith("--"):
            break
        for value in _from_flags(word):
            ref = _expand(value, declared)
            if ref.lower() not in stages and not ref.isdigit() and ref.lower() != "scratch":
                found.append(ref)
    return found


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


# ----------------------------------------------------------------------------- envbuild refs

#: ``FROM envbuild.invalid/env/NAME@sha256:<lock digest>`` names an env lock of the envbuild
#: store (``.invalid`` never resolves: no registry is ever asked for it).
LOCK_HOST = "envbuild.invalid"
LOCK_REF_RE = re.compile(rf"{re.escape(LOCK_HOST)}/(env/[a-z0-9][a-z0-9._-]*)@({DIGEST_PATTERN})")
#: ``FROM envbuild.invalid/env/NAME`` without a digest: the Env NAME of the same definition
#: tree, an edge of the graph (built and locked first; its lock inputs are in the key).
ENV_REF_RE = re.compile(rf"{re.escape(LOCK_HOST)}/env/([a-z0-9][a-z0-9._-]*)")
#: the pin of such a FROM: a name, not a digest (the key gets the env's lock inputs instead)
ENV_PIN_PREFIX = "env/"


def env_upstreams(dockerfile: str, args: Mapping[str, str]) -> tuple[str, ...]:
    """The env names of the ``FROM envbuild.invalid/env/NAME`` (no digest) references of the
    Dockerfile at ``dockerfile``, in order, once each (raises ``Unpinnable``/``OSError``)."""
    refs = from_images(read_small(dockerfile), args)
    return tuple(dict.fromkeys(m.group(1) for r in refs if (m := ENV_REF_RE.fullmatch(r))))


# ----------------------------------------------------------------------------- reading


def read_small(path: str, *, missing_ok: bool = False, limit: int = MAX_DOCKERFILE_BYTES) -> str:
    """The text of ``path`` (a Dockerfile, a ``.dockerignore``), not following a final symlink,
    at most ``limit`` bytes, strictly UTF-8 (the bytes hashed are the bytes docker reads)."""
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


def locate(src, base_dir: str, roots: tuple[str, ...] | None) -> tuple[str, str]:
    """``(context dir, Dockerfile path)``, both checked inside ``roots`` when given
    (``envbuild.defs.confine.source_roots``); raises ``Unpinnable``."""
    context = os.path.join(base_dir, src.context)
    if not os.path.isdir(context):
        raise Unpinnable(f"docker context {src.context} is not a directory",
                         f"it is resolved against {base_dir or '.'}/")
    if roots is not None:
        context = confined_path(roots, base_dir, src.context)
    dockerfile = os.path.join(context, src.file)
    # The Dockerfile's directory may be reached through links inside the source root; the
    # file itself is opened without following a final symlink.
    parent = os.path.dirname(dockerfile)
    if roots is not None:
        confined_path(roots, context, os.path.dirname(src.file) or ".")
    dockerfile = os.path.join(os.path.realpath(parent), os.path.basename(dockerfile))
    return os.path.realpath(context), dockerfile
