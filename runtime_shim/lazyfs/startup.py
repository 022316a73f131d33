"""The files a sandbox's start and its first program read before doing anything of their own,
known from the stack and the lock's environment: fetched ahead when a stack is first mounted.

A lazy create ends with runc starting the container, and the first command with glibc's
start-up; on a cold node each of their first opens is a round trip to the store, one after
the other (measured on the cold_start env at 1gbit:10ms: ``etc/passwd`` 30–38 ms inside the
create; ``LC_CTYPE``, ``gconv-modules.cache`` and the zone file 27–55 ms each in
``python3 -c 'print(1)'``). None of them is a guess about the workload:

- ``etc/passwd`` and ``etc/group``: runc resolves the process's user (and its groups) from
  them at every container start, numeric user or not;
- the locale of ``$LC_ALL`` / ``$LC_CTYPE`` / ``$LANG`` (the lock's environment; glibc's
  order): ``usr/lib/locale/locale-archive`` if the stack has one, else the files of the
  locale's directory (``C.UTF-8`` → ``C.utf8``, glibc's codeset normalisation, the name as
  written second) — what ``setlocale(LC_ALL, "")`` opens, and ``setlocale(LC_CTYPE, "")``
  opens a part of; for a locale other than C/POSIX, glibc's ``gconv-modules.cache``
  (``$GCONV_PATH``, else the multiarch and plain library dirs), which its multibyte
  conversions load;
- the time zone: the file ``$TZ`` names below ``usr/share/zoneinfo`` (or absolute), else
  ``/etc/localtime``'s target — what any ``localtime()`` reads.

And the lock's command (its ``cmd``: what the env is made to run — a prediction, but the one
the lock itself makes): the program ``PATH`` finds for it, a script's ``#!`` interpreter, and
the program's loader files (``elfdeps``), fetched after the files above. In a Python env this
is the interpreter every Python tool runs (``pytest`` → ``python3`` → ``python3.11``, 6.8 MB:
60–110 ms of the first command when it was a miss).

Hostile input: names come from the lock's environment and the layers' trees; they are table
keys looked up in the stack's trees (``elfdeps.Stack``: bounded symlink hops, never leaving
the trees), never opened as paths; a name with a ``..`` component or a NUL is ignored, and a
locale directory contributes at most ``MAX_LOCALE_FILES`` files of at most
``MAX_BYTES`` bytes in all.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Mapping
from typing import Any

from runtime_shim.lazyfs.elfdeps import Stack

#: The files runc reads to resolve a container process's user and groups.
USER_FILES = ("etc/passwd", "etc/group")
LOCALE_DIR = "usr/lib/locale"
LOCALE_ARCHIVE = "usr/lib/locale/locale-archive"
#: Where glibc looks for its conversion module cache without ``$GCONV_PATH`` (Debian's
#: multiarch dir first).
GCONV_DIRS = ("usr/lib/x86_64-linux-gnu/gconv", "usr/lib64/gconv", "usr/lib/gconv")
GCONV_CACHE = "gconv-modules.cache"
ZONEINFO = "usr/share/zoneinfo"
LOCALTIME = "etc/localtime"
MAX_LOCALE_FILES = 32
MAX_BYTES = 4 << 20
_NAME = re.compile(r"[A-Za-z0-9_.@+,=-]{1,128}")


def locale_of(env: Mapping[str, str]) -> str:
    """The locale glibc's ``setlocale(LC_CTYPE, "")`` takes from ``env`` (``LC_ALL``, then
    ``LC_CTYPE``, then ``LANG``), or ``""`` for the built-in C/POSIX locale or a name that is
    not a plain locale name."""
    for var in ("LC_ALL", "LC_CTYPE", "LANG"):
        value = env.get(var) or ""
        if value:
            break
    if value in ("C", "POSIX") or not _NAME.fullmatch(value) or ".." in value:
        return ""
    return value


def locale_dirs(name: str) -> list[str]:
    """The directory names glibc tries for locale ``name``: the codeset normalised
    (lower-case alphanumerics: ``C.UTF-8`` → ``C.utf8``), then as written."""
    base, dot, rest = name.partition(".")
    if not dot:
        return [name]
    codeset, at, modifier = rest.partition("@")
    norm = "".join(c.lower() for c in codeset if c.isalnum())
    if norm.isdigit():
        norm = "iso" + norm
    first = f"{base}.{norm}{at}{modifier}"
    return [first] if first == name else [first, name]


def zone_file(env: Mapping[str, str]) -> str:
    """The zone file ``$TZ`` names (``:`` prefix dropped, relative to ``ZONEINFO``), or
    ``LOCALTIME`` without ``$TZ``; ``""`` for a ``$TZ`` that is not a file name."""
    tz = env.get("TZ")
    if tz is None:
        return LOCALTIME
    tz = tz.removeprefix(":")
    if not tz or "\0" in tz or ".." in tz.split("/") or len(tz) > 255:
        return ""
    return tz.lstrip("/") if tz.startswith("/") else f"{ZONEINFO}/{tz}"


def _dir(stack: Stack, path: str) -> tuple[Any, Any] | None:
    """The topmost directory node at ``path`` in the stack (no symlinks followed here)."""
    for ops in stack.layers:
        node = ops.lazy_nodes.get(path)
        if node is not None:
            return (ops, node) if node.children is not None else None
    return None


def startup_files(stack: Stack, env: Mapping[str, str]) -> list[tuple[Any, Any]]:  # noqa: C901  a list of the start-up's file sources, each a guarded two-liner
    """``(ops, node)`` of the regular files a container start and a program's libc start-up
    read in ``stack`` under the environment ``env`` (module docstring), each once."""
    out: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    budget = [MAX_BYTES]

    def add(hit: tuple[Any, Any] | None) -> None:
        if hit is None or id(hit[1]) in seen or not stat.S_ISREG(hit[1].mode):
            return
        if hit[1].size > budget[0]:
            return
        budget[0] -= hit[1].size
        seen.add(id(hit[1]))
        out.append(hit)

    for path in USER_FILES:
        add(stack.lookup(path))
    name = locale_of(env)
    if name:
        archive = stack.lookup(LOCALE_ARCHIVE)
        if archive is not None:
            add(archive)
        else:
            for d in locale_dirs(name):
                if _dir(stack, f"{LOCALE_DIR}/{d}") is None:
                    continue
                files = 0
                for sub in ("", "LC_MESSAGES/"):   # glibc's category files, and messages'
                    for child in sorted(stack.names(f"{LOCALE_DIR}/{d}/{sub}".rstrip("/"),
                                                    MAX_LOCALE_FILES)):
                        if files >= MAX_LOCALE_FILES:
                            break
                        hit = stack.lookup(f"{LOCALE_DIR}/{d}/{sub}{child}")
                        if hit is not None:
                            files += 1
                            add(hit)
                break
        gconv = env.get("GCONV_PATH")
        dirs = [p.strip("/") for p in gconv.split(":")] if gconv else list(GCONV_DIRS)
        for d in dirs[:8]:
            if d and ".." not in d.split("/"):
                hit = stack.lookup(f"{d}/{GCONV_CACHE}")
                if hit is not None:
                    add(hit)
                    break
    zone = zone_file(env)
    if zone:
        add(stack.lookup(zone))
    return out


#: PATH entries searched for the lock's command, and ``#!`` hops followed from it.
MAX_PATH_DIRS = 32
MAX_SCRIPT_HOPS = 2
#: Bytes of a script's first line read for its ``#!`` interpreter (the kernel reads 256).
SHEBANG_MAX = 256


def command_file(stack: Stack, env: Mapping[str, str], program: str) -> tuple[Any, Any] | None:
    """``(ops, node)`` of the file ``execve`` runs for ``program`` (the lock's command, or a
    script's interpreter): a path as is, a bare name searched in ``env``'s ``PATH`` (the
    first ``MAX_PATH_DIRS`` entries) as ``execvp`` does; None if the stack has none."""
    if not program or "\0" in program or len(program) > 4096:
        return None
    if "/" in program:
        return stack.lookup(program)
    for d in (env.get("PATH") or "").split(":")[:MAX_PATH_DIRS]:
        if d.startswith("/"):
            hit = stack.lookup(f"{d}/{program}")
            if hit is not None:
                return hit
    return None


#: How deep below the root a venv's ``pyvenv.cfg`` is looked for (``opt/venv/pyvenv.cfg``:
#: 3 parts; ``opt/toolkits/pytest/venv/pyvenv.cfg``: 5), and how many are taken.
VENV_DEPTH = 6
MAX_VENVS = 16


def venv_configs(layers: list[Any]) -> list[str]:
    """The ``pyvenv.cfg`` files of the venvs in ``layers`` (mounts, top first), at most
    ``VENV_DEPTH`` path parts deep and ``MAX_VENVS`` of them, shallowest first: a venv in an
    env's image is there to be run. Paths of the stack's trees (names, not opened paths)."""
    found: set[str] = set()
    for ops in layers:
        for path in ops.lazy_nodes:
            if path.endswith("/pyvenv.cfg") and path.count("/") < VENV_DEPTH:
                found.add(path)
    return sorted(found, key=lambda p: (p.count("/"), p))[:MAX_VENVS]


def shebang(data: bytes) -> str:
    """The program a script's ``#!`` line runs (``/usr/bin/env NAME`` → ``NAME``, to be
    searched in ``PATH``), or ``""`` when ``data`` is no script."""
    if not data.startswith(b"#!"):
        return ""
    line = data[2:SHEBANG_MAX].split(b"\n", 1)[0].decode("utf-8", "replace").split()
    if not line:
        return ""
    if line[0].rsplit("/", 1)[-1] == "env":
        rest = [a for a in line[1:] if not a.startswith("-")]
        return rest[0] if rest else ""
    return line[0]
