"""What every ``python3`` opens before its first import of the program's.

The interpreter's start-up files (the ``encodings`` package, ``sitecustomize``, the ``.pth``
files of its site directories, a venv's ``pyvenv.cfg`` and its ``.pth`` files) and the
modules those ``.pth`` files import — predicted at the interpreter's first open
(``fillhints``) so they are filled before the interpreter asks for them one after the other."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

#: ``.../bin/python3.N`` (the interpreter's own file: ``python3`` and a venv's ``python`` are
#: symlinks to it) and a venv's ``pyvenv.cfg``.
_INTERPRETER = re.compile(r"^(?P<prefix>(?:.*/)?)bin/python3\.(?P<minor>\d{1,2})$")
_PYVENV = re.compile(r"^(?P<venv>(?:.*/)?)pyvenv\.cfg$")
#: Largest ``.pth`` file read for its ``import`` lines (site.py runs them at start-up).
MAX_PTH = 64 << 10
#: Names read per layer from a site or venv lib directory (``Stack.names``).
MAX_DIR_NAMES = 10_000
_PTH_IMPORT = re.compile(r"__import__\(\s*['\"]([A-Za-z_][A-Za-z0-9_.]*)['\"]")


def startup_files(stack: Any, path: str) -> tuple[str, list[str], list[tuple[Any, Any]]]:
    """For the first open of ``path``: when it is an interpreter (``PREFIX/bin/python3.N``),
    the files its start-up opens before any import of the program's — the ``encodings``
    package (``__init__``, ``aliases``, ``utf_8``), ``sitecustomize`` and the ``.pth`` files
    of its site directories (Debian's and a source build's); when it is a venv's
    ``pyvenv.cfg``, the ``.pth`` files of the venv's site-packages. Returns ``(pyc tag,
    site directories, files)``; ``("", [], [])`` for any other path."""
    m = _INTERPRETER.match(path)
    if m is not None:
        prefix, v = m["prefix"], f"3.{m['minor']}"
        tag = f"cpython-3{m['minor']}"
        std = f"{prefix}lib/python{v}"
        files: list[tuple[Any, Any]] = []
        for name in ("encodings.__init__", "encodings.aliases", "encodings.utf_8",
                     "sitecustomize"):
            pkg, _, leaf = name.rpartition(".")
            d = f"{std}/{pkg}" if pkg else std
            for p in (f"{d}/__pycache__/{leaf}.{tag}.pyc", f"{d}/{leaf}.py"):
                hit = stack.lookup(p)
                if hit is not None:
                    files.append(hit)
        sites = [f"{prefix}local/lib/python{v}/dist-packages", f"{prefix}lib/python3/dist-packages",
                 f"{prefix}lib/python{v}/dist-packages", f"{prefix}lib/python{v}/site-packages",
                 f"{prefix}local/lib/python{v}/site-packages"]
        return tag, sites, files + _pth_files(stack, sites)
    m = _PYVENV.match(path)
    if m is not None:
        lib = f"{m['venv']}lib"
        sites = [f"{lib}/{name}/site-packages" for name in sorted(stack.names(lib, MAX_DIR_NAMES))
                 if re.match(r"^python3\.\d{1,2}$", name)][:4]
        tags = [f"cpython-3{s.split('/')[-2].split('.')[1]}" for s in sites]
        return (tags[0] if tags else ""), sites, _pth_files(stack, sites)
    return "", [], []


def _pth_files(stack: Any, sites: Sequence[str]) -> list[tuple[Any, Any]]:
    out = []
    for site in sites:
        for name in sorted(stack.names(site, MAX_DIR_NAMES)):
            if name.endswith(".pth"):
                hit = stack.lookup(f"{site}/{name}")
                if hit is not None:
                    out.append(hit)
    return out[:256]


def pth_imports(data: bytes) -> list[str]:
    """The modules a ``.pth`` file imports when ``site`` processes it: its lines that start
    with ``import`` are executed — ``import a, b`` and ``__import__('c')`` in them name
    modules (other lines are path entries). At most ``MAX_PTH`` bytes are read."""
    out: list[str] = []
    for raw in data[:MAX_PTH].decode("utf-8", "replace").splitlines():
        line = raw.strip()
        if not (line.startswith("import ") or line.startswith("import\t")):
            continue
        first = line[len("import"):].split(";", 1)[0]
        for part in first.split(","):
            name = part.strip().split(" as ", 1)[0].strip()
            if re.match(r"^[A-Za-z_][A-Za-z0-9_.]*$", name):
                out.append(name)
        out.extend(_PTH_IMPORT.findall(line))
    return list(dict.fromkeys(out))[:64]
