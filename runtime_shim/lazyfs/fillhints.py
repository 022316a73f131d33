"""What the native filler fills before anyone opens it: the files an open predicts, from the
predictors over the stack of layers a create registered (``Hints.add_stack``).

- an interpreter's first open (``.../bin/python3.N``) or a venv's ``pyvenv.cfg``: its
  start-up files (``pystartup``: ``encodings``, ``sitecustomize``, the ``.pth`` files);
- a ``.pyc``'s open: the whole import closure of its module-level imports, resolved over the
  stack (``pydeps.predict``) from the layers' import indexes (``pyindex``: records made when
  a layer is packed; no pyc is read or scanned here), each module expanded once a stack;
- an ELF file once filled (its bytes in hand; on its open or ahead of it): its interpreter,
  the loader's cache and its needed libraries, in its run path (``$ORIGIN`` too: the
  ``numpy.libs`` of an extension module) and the loader's directories (``elfdeps``);
- a stack registered (a create, just before its sandbox starts): the files the start reads
  (``START_FILES``: runc resolves the user in ``/etc/passwd`` and ``/etc/group``).

A hint only: a layer without an index, a path the stack does not resolve, a damaged record
predict nothing, and a predicted file is still verified like any fill (``fillworker``).
Bounded: ``MAX_PREDICTED`` files an open, ``MAX_STACK`` layers a stack, ``MAX_STACKS``
stacks remembered; the layers' trees are the ones ``tree_of`` builds (the member cap of
``nativetree`` applies)."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from envbuild.oci import is_hex64
from runtime_shim.lazyfs import pydeps, pystartup
from runtime_shim.lazyfs.elfdeps import Stack

log = logging.getLogger("envbuild.lazyfs.filler")

#: Files one open predicts at most (an import of numpy, pandas and django: ~1,300).
MAX_PREDICTED = 4096
MAX_STACK = 128
MAX_STACKS = 1024
#: Module files (pycs) expanded per stack before the set is forgotten (then re-expanded).
MAX_EXPANDED = 200_000
#: What every sandbox's start reads from its layers: runc resolves the user in them.
START_FILES = ("etc/passwd", "etc/group")


class LayerView:
    """A layer as the predictors look at it (an ``elfdeps.Stack`` layer): its tree
    (``tree_of``) and its import index (``pyindex.ImportIndex`` or None)."""

    def __init__(self, hexd: str, nodes: dict[str, Any], index: Any) -> None:
        self.hexd, self.lazy_nodes, self.py_index = hexd, nodes, index


class Hints:
    """The node's predictions (module docstring). ``view_of(layer_hex)`` gives a layer's
    ``LayerView`` (None: unknown), called once a layer."""

    def __init__(self, view_of: Callable[[str], LayerView | None]) -> None:
        self.view_of = view_of
        self._lock = threading.Lock()
        self._views: dict[str, LayerView | None] = {}
        self._stack_of: dict[str, tuple[str, ...]] = {}   # layer -> last stack holding it
        self._stacks: dict[tuple[str, ...], pydeps.CachedStack] = {}
        self._roots: dict[tuple[str, ...], list[str]] = {}
        self._expanded: dict[tuple[str, ...], set[str]] = {}

    def add_stack(self, layers: Sequence[str]) -> None:
        """A sandbox's layers, top first (hexes): the stack its opens are resolved in."""
        key = tuple(h for h in layers if is_hex64(h))[:MAX_STACK]
        with self._lock:
            if len(self._stacks) >= MAX_STACKS:
                self._stacks.clear()
                self._stack_of.clear()
            for h in key:
                self._stack_of[h] = key

    def on_open(self, layer_hex: str, path: str) -> list[str]:
        """The objects (hexes) an open of ``path`` of layer ``layer_hex`` predicts."""
        got = self._stack(layer_hex)
        if got is None:
            return []
        key, st = got
        _tag, _sites, files = pystartup.startup_files(st, path)
        pycs = [path] if pydeps.is_pyc(path) else []
        pycs += [node.read_path for _, node in files if pydeps.is_pyc(node.read_path)]
        return _hexes(files + self._closure(key, st, pycs))

    def on_start(self, layer_hex: str) -> list[str]:
        """The objects a sandbox of the stack whose top layer is ``layer_hex`` reads as it
        starts (``START_FILES``)."""
        got = self._stack(layer_hex)
        if got is None:
            return []
        return _hexes([hit for hit in map(got[1].lookup, START_FILES) if hit is not None])

    def on_elf(self, layer_hex: str, data: bytes, path: str = "") -> list[str]:
        """The objects the dynamic loader opens for the ELF file ``data`` of layer
        ``layer_hex`` (at ``path``: its run path's ``$ORIGIN``)."""
        got = self._stack(layer_hex)
        if got is None or data[:4] != b"\x7fELF":
            return []
        return _hexes(got[1].stack.dependencies(data, path))

    def _stack(self, layer_hex: str) -> tuple[tuple[str, ...], pydeps.CachedStack] | None:
        with self._lock:
            key = self._stack_of.get(layer_hex)
            st = self._stacks.get(key) if key else None
        if key is None:
            return None
        if st is not None:
            return key, st
        views = [v for v in (self._view(h) for h in key) if v is not None]
        st = pydeps.CachedStack(Stack(views))
        with self._lock:
            st = self._stacks.setdefault(key, st)
        return key, st

    def _view(self, hexd: str) -> LayerView | None:
        with self._lock:
            if hexd in self._views:
                return self._views[hexd]
        try:
            view = self.view_of(hexd)
        except Exception as e:  # noqa: BLE001 - a hint: no view, no prediction in it
            log.warning("hints: layer %s: %s", hexd[:16], e)
            view = None
        with self._lock:
            return self._views.setdefault(hexd, view)

    def _closure(self, key: tuple[str, ...], st: pydeps.CachedStack,
                 start: list[str]) -> list[tuple[Any, Any]]:
        """The files of the import closure of the modules at ``start`` (pyc paths), each
        module expanded once per stack, at most ``MAX_PREDICTED`` files."""
        with self._lock:
            roots = self._roots.setdefault(key, [])
            done = self._expanded.setdefault(key, set())
            if len(done) > MAX_EXPANDED:
                done.clear()
        out: list[tuple[Any, Any]] = []
        todo = collections.deque(start)
        while todo and len(out) < MAX_PREDICTED:
            path = todo.popleft()
            with self._lock:
                if path in done:
                    continue
                done.add(path)
            hit = st.lookup(path)
            index = getattr(hit[0], "py_index", None) if hit is not None else None
            imports = index.imports(hit[1].read_path) if index is not None else None
            if imports is None:
                continue
            info, files = pydeps.predict(st, path, b"", roots, imports=imports)
            if info is not None and info.root not in roots and len(roots) < 16:
                roots.append(info.root)
            out.extend(files)
            todo.extend(n.read_path for _, n in files if pydeps.is_pyc(n.read_path))
        return out


def _hexes(hits: Sequence[tuple[Any, Any]]) -> list[str]:
    out = dict.fromkeys(str(node.digest).removeprefix("sha256:") for _, node in hits)
    return [h for h in out if is_hex64(h)]


__all__ = ["MAX_PREDICTED", "Hints", "LayerView"]
