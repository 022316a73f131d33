"""What a Python module will import next: the module-level imports of a fetched ``.pyc``,
resolved to the files the import system will open, so the filler fills them before the
(single-threaded) importer asks for them one after the other.

An ``import numpy`` on a cold node is a chain of misses: the importer opens a module's
``.pyc`` (and, for checked-hash pycs, its ``.py`` to hash the source), runs it, and only then
opens the next module it imports — every open a round trip to the store. The names are in
the bytes just fetched: the module's code object has one ``IMPORT_NAME`` instruction per
import statement it runs, with the import's level and fromlist in the two ``LOAD_CONST``
before it. ``scan`` finds them (module level and class bodies only: functions' imports mostly
never run; imports under ``if TYPE_CHECKING:`` are skipped), ``module_files`` maps a module to
the files its import opens (``__pycache__/NAME.TAG.pyc`` + ``NAME.py``, a package's
``__init__`` pair, or an extension module), looked up in the stack's trees (``elfdeps.Stack``).
(The files every interpreter opens before its first import are in ``pystartup``.)

Hostile input: a pyc comes from a verified layer, but its content is anyone's. It is never
given to ``marshal.loads`` (not safe against malicious data); ``scan`` is a reader of the
marshal format that is bounded — at most ``MAX_PYC`` input bytes, ``MAX_OBJECTS`` objects,
``MAX_DEPTH`` nesting levels, lengths checked against the buffer before any slice, refs only
to objects already read (no cycles can be built) — and returns ``[]`` for anything malformed;
it never raises.

Versions: the pyc's magic number selects the format. CPython 3.11 (magic 3495) is read (code
object layout and opcodes of 3.11, checked against ``dis`` in the tests); any other magic
number gives ``[]`` (no hint: the importer's own opens fetch as before).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: Largest pyc read (bytes): larger ones are not scanned (numpy's largest is ~300 KB).
MAX_PYC = 4 << 20
#: Objects read from one pyc (strings, ints, tuples, code objects, ...).
MAX_OBJECTS = 400_000
#: Nesting of containers and code objects (CPython allows 2000; real code needs < 50).
MAX_DEPTH = 100
#: Imports reported per pyc.
MAX_IMPORTS = 1024
#: Longest dotted module name (characters) and most names in one fromlist considered.
MAX_NAME = 256
MAX_FROMLIST = 256
#: fromlist names reported per pyc, over all its imports.
MAX_NAMES_TOTAL = 8192

#: pyc magic number -> the format's opcodes (3.11: ``dis.opmap`` of CPython 3.11).
_MAGIC_311 = (3495).to_bytes(2, "little") + b"\r\n"
_OP_CACHE, _OP_LOAD_CONST, _OP_LOAD_NAME, _OP_LOAD_ATTR = 0, 100, 101, 106
_OP_IMPORT_NAME, _OP_POP_JUMP_FORWARD_IF_FALSE, _OP_LOAD_GLOBAL = 108, 114, 116
_OP_EXTENDED_ARG = 144
_CO_OPTIMIZED = 0x1   # a function's code (not a module's or class body's)
_FLAG_REF = 0x80


@dataclass(frozen=True)
class Import:
    """One ``IMPORT_NAME``: ``import name`` / ``from name import *fromlist`` at ``level``
    (0 absolute, 1 ``from .``, ...)."""

    name: str
    level: int
    fromlist: tuple[str, ...]


class CachedStack:
    """An ``elfdeps.Stack`` whose lookups are remembered (at most ``limit`` paths): the
    resolution of one import tries several roots and suffixes, and the same names (``os``,
    ``typing``, ``sys``) are imported by most modules."""

    def __init__(self, stack: Any, limit: int = 200_000) -> None:
        self.stack, self.layers, self.limit = stack, stack.layers, limit
        self.memo: dict[str, Any] = {}
        #: ``(root, name, tag, opt)`` -> the files of that module there (``_files_in``): an
        #: import closure asks for the same modules from many importers, and each miss in a
        #: root is five lookups (measured: resolution 0.79 -> s per workload's closure)
        self.modules: dict[tuple[str, str, str, str], list[tuple[Any, Any]]] = {}
        self.dir_names: dict[str, set[str]] = {}   # directory -> its entries' stems

    def names(self, path: str, per_layer: int) -> list[str]:
        return list(self.stack.names(path, per_layer))

    def may_hold(self, directory: str, name: str) -> bool:
        """Whether any layer's ``directory`` (symlinks resolved) has an entry whose name is
        ``name`` up to its first dot: a module ``name`` there may exist. Most of a fromlist's
        names are attributes, not submodules, and each costs five lookups to rule out; one
        set per directory rules them out at once (false positives only: a whiteout is in
        the set, and the lookups decide)."""
        names = self.dir_names.get(directory)
        if names is None:
            names = set()
            where = self.stack._dir(directory) if directory else ""
            if where is not None:
                for ops in self.layers:
                    node = ops.lazy_nodes.get(where)
                    if node is not None and node.children:
                        names.update(n.split(".", 1)[0] for n in node.children)
            if len(self.dir_names) >= 20_000:
                self.dir_names.clear()
            self.dir_names[directory] = names
        return name in names

    def lookup(self, path: str) -> Any:
        try:
            return self.memo[path]
        except KeyError:
            pass
        hit = self.stack.lookup(path)
        if len(self.memo) >= self.limit:
            self.memo.clear()
        self.memo[path] = hit
        return hit


class _Malformed(Exception):
    pass


@dataclass
class _Code:
    flags: int
    code: bytes
    consts: tuple[Any, ...]
    names: tuple[Any, ...]


_UNSET = object()   # a reserved ref slot not filled yet (refs to it read as None)


# The reader's state (the buffer, the position, the refs) lives in closure cells: it runs over
# every pyc an import touches, in the filler, and methods reading that state from an object
# were 3x slower. ``r`` reads one object (scalars and sequences, the most frequent, inline)
# and hands the others to ``code``, ``mapping`` and ``number``.
# shape: one closure for speed (above); each function inside it is under 60 lines
def _parse(data: bytes, start: int) -> Any:  # noqa: C901, PLR0912, PLR0915  (shape: above)
    """The object at ``start`` of marshal data (CPython 3.11's ``Python/marshal.c``), bounded
    (module docstring); raises ``_Malformed``. Values: None/bool/int/str/bytes/tuple (lists,
    sets and dicts as tuples), ``_Code``; floats, complexes and big ints as None (an import's
    level is a small int). One closure with local state: this runs over every pyc an import
    touches (a method per field read was 3x slower)."""
    n = len(data)
    refs: list[Any] = []
    pos = start
    count = 0

    def u32() -> int:
        nonlocal pos
        if pos + 4 > n:
            raise _Malformed
        v = int.from_bytes(data[pos:pos + 4], "little")
        pos += 4
        return v

    def byte() -> int:
        nonlocal pos
        if pos >= n:
            raise _Malformed
        v = data[pos]
        pos += 1
        return v

    def skip(k: int) -> None:
        nonlocal pos
        if k < 0 or pos + k > n:
            raise _Malformed
        pos += k

    def blob(k: int) -> bytes:
        nonlocal pos
        if pos + k > n:
            raise _Malformed
        out = data[pos:pos + k]
        pos += k
        return out

    def r(depth: int) -> Any:
        nonlocal pos, count
        count += 1
        if depth > MAX_DEPTH or count > MAX_OBJECTS or pos >= n:
            raise _Malformed
        c = data[pos]
        pos += 1
        flag, t = c & _FLAG_REF, c & 0x7F
        if t == 0x72:    # r: ref to an earlier object
            idx = u32()
            if idx >= len(refs):
                raise _Malformed
            v = refs[idx]
            return None if v is _UNSET else v
        if t in (0x5A, 0x7A):    # Z z: short ASCII (interned)
            return _ref(flag, blob(byte()).decode("latin-1"))
        if t in (0x29, 0x28, 0x5B, 0x3C, 0x3E):   # ) ( [ < >: tuple, list, set, frozenset
            k = byte() if t == 0x29 else u32()
            if k > n - pos:   # each item is at least one byte
                raise _Malformed
            idx = _reserve(flag)
            v = tuple([r(depth + 1) for _ in range(k)])
            if idx >= 0:
                refs[idx] = v
            return v
        if t == 0x73:    # s: bytes
            return _ref(flag, blob(u32()))
        if t in (0x61, 0x41, 0x75, 0x74):   # a A u t: str
            return _ref(flag, blob(u32()).decode("utf-8", "surrogatepass"))
        if t == 0x63:    # c: code
            return code(flag, depth)
        if t == 0x69:    # i: int32
            return _ref(flag, int.from_bytes(blob(4), "little", signed=True))
        if t in (0x4E, 0x46, 0x54, 0x53, 0x2E):   # N F T S .
            return _ref(flag, True if t == 0x54 else False if t == 0x46 else None)
        if t == 0x7B:    # {: dict, pairs until NULL
            return mapping(flag, depth)
        return number(flag, t)

    def code(flag: int, depth: int) -> _Code:
        idx = _reserve(flag)
        skip(16)     # argcount, posonlyargcount, kwonlyargcount, stacksize
        flags = u32()
        co, consts, names = r(depth + 1), r(depth + 1), r(depth + 1)
        for _ in range(5):   # localsplusnames, localspluskinds, filename, name, qualname
            r(depth + 1)
        skip(4)      # firstlineno
        r(depth + 1)  # linetable
        r(depth + 1)  # exceptiontable
        if not (isinstance(co, bytes) and isinstance(consts, tuple)
                and isinstance(names, tuple)):
            raise _Malformed
        v = _Code(flags, co, consts, names)
        if idx >= 0:
            refs[idx] = v
        return v

    def mapping(flag: int, depth: int) -> tuple[Any, ...]:
        nonlocal pos
        idx = _reserve(flag)
        items = []
        while True:
            if pos >= n:
                raise _Malformed
            if data[pos] == 0x30:
                pos += 1
                break
            items.append(r(depth + 1))
            items.append(r(depth + 1))
        v = tuple(items)
        if idx >= 0:
            refs[idx] = v
        return v

    def number(flag: int, t: int) -> Any:
        """A long, int64, float or complex, skipped (read as None)."""
        if t == 0x6C:    # l: long, digits of 15 bits
            k = int.from_bytes(blob(4), "little", signed=True)
            skip(2 * abs(k))
        elif t in (0x49, 0x67, 0x79):   # I g y: int64, binary float, binary complex
            skip(16 if t == 0x79 else 8)
        elif t in (0x66, 0x78):   # f x: float, complex as text
            for _ in range(1 if t == 0x66 else 2):
                skip(byte())
        else:
            raise _Malformed   # 0 (NULL outside a dict), ? (unknown), anything else
        return _ref(flag, None)

    def _reserve(flag: int) -> int:
        if not flag:
            return -1
        refs.append(_UNSET)
        return len(refs) - 1

    def _ref(flag: int, v: Any) -> Any:
        if flag:
            refs.append(v)
        return v

    return r(0)


def scan(data: bytes) -> list[Import]:
    """The imports a CPython 3.11 ``.pyc`` (``data``: the whole file) runs when its module is
    imported: ``IMPORT_NAME`` instructions of the module's code and of its class bodies (not
    of functions), in bytecode order, except those under ``if TYPE_CHECKING:``. ``[]`` for
    another version, anything malformed, or more than ``MAX_PYC`` bytes; never raises."""
    try:
        if len(data) < 17 or len(data) > MAX_PYC or data[:4] != _MAGIC_311:
            return []
        top = _parse(data, 16)
        if not isinstance(top, _Code):
            return []
        out: list[Import] = []
        todo, seen = [top], 0
        while todo and seen < 10_000:
            code = todo.pop(0)
            seen += 1
            out.extend(_imports(code))
            # class bodies run at import time; function bodies (CO_OPTIMIZED) do not
            todo.extend(c for c in code.consts
                        if isinstance(c, _Code) and not c.flags & _CO_OPTIMIZED)
        out, names = out[:MAX_IMPORTS], 0
        for k, imp in enumerate(out):
            names += len(imp.fromlist)
            if names > MAX_NAMES_TOTAL:
                return out[:k]
        return out
    except (_Malformed, UnicodeDecodeError, struct.error, IndexError, RecursionError,
            MemoryError):
        return []


def _instructions(co: bytes) -> list[tuple[int, int, int]]:
    """``(unit index, opcode, oparg with EXTENDED_ARG applied)`` of 3.11 bytecode, inline
    caches left out."""
    out, ext = [], 0
    for i in range(0, len(co) - 1, 2):
        op, arg = co[i], co[i + 1] | ext
        if op == _OP_EXTENDED_ARG:
            ext = arg << 8
            continue
        ext = 0
        if op != _OP_CACHE:
            out.append((i // 2, op, arg))
    return out


def _name(seq: tuple[Any, ...], i: int) -> Any:
    return seq[i] if 0 <= i < len(seq) else None


def _imports(code: _Code) -> list[Import]:
    ins = _instructions(code.code)
    out: list[Import] = []
    skip_until = -1
    for k, (unit, op, arg) in enumerate(ins):
        if unit < skip_until:
            continue
        if op in (_OP_LOAD_NAME, _OP_LOAD_GLOBAL, _OP_LOAD_ATTR) and k + 1 < len(ins):
            namei = arg >> 1 if op == _OP_LOAD_GLOBAL else arg
            nxt = ins[k + 1]
            if (_name(code.names, namei) == "TYPE_CHECKING"
                    and nxt[1] == _OP_POP_JUMP_FORWARD_IF_FALSE):
                skip_until = nxt[0] + 1 + nxt[2]   # the block's end: a relative jump
            continue
        if op != _OP_IMPORT_NAME or k < 2:
            continue
        a, b = ins[k - 2], ins[k - 1]
        if a[1] != _OP_LOAD_CONST or b[1] != _OP_LOAD_CONST:
            continue
        name, level, fromlist = (_name(code.names, arg), _name(code.consts, a[2]),
                                 _name(code.consts, b[2]))
        if (not isinstance(name, str) or len(name) > MAX_NAME or type(level) is not int
                or not 0 <= level <= 32):
            continue
        names = tuple(x for x in fromlist[:MAX_FROMLIST] if isinstance(x, str)
                      and x != "*" and len(x) <= MAX_NAME) if isinstance(fromlist, tuple) else ()
        out.append(Import(name, level, names))
    return out


# -- resolution: a module name to the files its import opens ------------------------------------

#: ``.../__pycache__/NAME.TAG.pyc`` (TAG e.g. ``cpython-311``; optimization levels too).
_PYC = re.compile(r"^(?P<dir>(?:.*/)?)__pycache__/(?P<name>[^/.]+)\.(?P<tag>cpython-\d+)"
                  r"(?P<opt>\.opt-\d)?\.pyc$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Modules CPython 3.11 imports from its frozen copies (before any search of the path; its
#: ``_imp._frozen_module_names()``, the test modules left out): their files are never opened.
FROZEN = {"cpython-311": frozenset({
    "_collections_abc", "_sitebuiltins", "abc", "codecs", "genericpath", "importlib.machinery",
    "importlib.util", "io", "ntpath", "os", "os.path", "posixpath", "runpy", "site", "stat",
    "zipimport"})}
#: Extension module suffixes, in the import system's order (x86_64 Linux).
EXTENSION_SUFFIXES = (".{tag}-x86_64-linux-gnu.so", ".abi3.so", ".so")


@dataclass(frozen=True)
class PycInfo:
    """Where a ``__pycache__`` pyc sits: its module's ``name`` (dotted), the ``root`` it was
    imported from (the first ancestor directory without ``__init__.py``), whether it is a
    package's ``__init__``, its cache ``tag`` and its source file's path."""

    name: str
    root: str
    is_package: bool
    tag: str
    opt: str
    source: str


_ANY_PYC = re.compile(r"/__pycache__/[^/]+\.pyc$")


def is_pyc(path: str) -> bool:
    """Whether ``path`` (in a layer) is a cached module (``__pycache__/*.pyc``)."""
    return bool(_ANY_PYC.search("/" + path))


def pyc_info(stack: Any, path: str) -> PycInfo | None:
    """The module of the pyc at ``path`` (relative to the stack's root) or None when it is
    not a ``__pycache__`` pyc. ``stack``: an ``elfdeps.Stack``."""
    m = _PYC.match(path)
    if m is None:
        return None
    directory, stem, tag = m["dir"].rstrip("/"), m["name"], m["tag"]
    parts = directory.split("/") if directory else []
    pkg: list[str] = []
    # walk up while the directory is a package (bounded by the path's own depth)
    while parts and _IDENT.match(parts[-1]) and _is_file(stack, "/".join(parts) + "/__init__.py"):
        pkg.insert(0, parts.pop())
    root = "/".join(parts)
    is_package = stem == "__init__"
    if is_package:
        if not pkg:
            return None
        name = ".".join(pkg)
    else:
        name = ".".join([*pkg, stem])
    return PycInfo(name, root, is_package, tag, m["opt"] or "",
                   f"{directory}/{stem}.py" if directory else f"{stem}.py")


def _is_file(stack: Any, path: str) -> bool:
    return stack.lookup(path) is not None


def stdlib_roots(tag: str) -> list[str]:
    """The interpreter's own search path for a pyc ``tag`` (``cpython-311`` -> python3.11):
    the standard library and its extension modules, Debian's and a source build's."""
    m = re.match(r"^cpython-3(\d+)$", tag)
    if m is None:
        return []
    v = f"python3.{m[1]}"
    return [f"usr/lib/{v}", f"usr/lib/{v}/lib-dynload", f"usr/local/lib/{v}",
            f"usr/local/lib/{v}/lib-dynload"]


def absolute_names(info: PycInfo, imp: Import) -> list[str]:
    """The dotted module names ``imp`` (an import of the module ``info``) may import, in the
    order their files are opened: each parent package first, then the module, then the
    fromlist's names as submodules (``from pkg import a``: ``pkg.a`` if it is a module)."""
    if imp.level:
        pkg = info.name.split(".") if info.is_package else info.name.split(".")[:-1]
        if imp.level - 1 >= len(pkg):
            return []   # beyond the top-level package: the import fails
        base = pkg[:len(pkg) - (imp.level - 1)]
        full = base + (imp.name.split(".") if imp.name else [])
    else:
        full = imp.name.split(".")
    if not all(_IDENT.match(p) for p in full):
        return []
    out = [".".join(full[:k]) for k in range(1, len(full) + 1)]
    out += [f"{out[-1]}.{x}" for x in imp.fromlist if _IDENT.match(x)]
    return out


def module_files(stack: Any, roots: Sequence[str], name: str, tag: str,
                 opt: str = "") -> tuple[str, list[tuple[Any, Any]]]:
    """``(root, files)``: the files the import of module ``name`` opens, found in the first of
    ``roots`` that has its top-level package or module (``(ops, node)`` as
    ``elfdeps.Stack.lookup`` gives them: pyc first, then source; or the extension module);
    ``("", [])`` when no root has it."""
    memo = getattr(stack, "modules", None)
    parts = name.split(".")
    for root in roots:
        if memo is None:
            files = _files_in(stack, root, parts, tag, opt)
        else:
            key = (root, name, tag, opt)
            files = memo.get(key)
            if files is None:
                if len(memo) >= stack.limit:
                    memo.clear()
                files = memo[key] = _files_in(stack, root, parts, tag, opt)
        if files:
            return root, files
    return "", []


def _files_in(stack: Any, root: str, parts: list[str], tag: str,
              opt: str) -> list[tuple[Any, Any]]:
    base = f"{root}/{'/'.join(parts)}" if root else "/".join(parts)
    head, _, leaf = base.rpartition("/")
    if isinstance(stack, CachedStack) and not stack.may_hold(head, leaf):
        return []
    init = stack.lookup(f"{base}/__init__.py")
    if init is not None:
        pyc = stack.lookup(f"{base}/__pycache__/__init__.{tag}{opt}.pyc")
        return ([pyc] if pyc else []) + [init]
    src = stack.lookup(f"{base}.py")
    if src is not None:
        pyc = stack.lookup(f"{head}/__pycache__/{leaf}.{tag}{opt}.pyc" if head
                           else f"__pycache__/{leaf}.{tag}{opt}.pyc")
        return ([pyc] if pyc else []) + [src]
    for suffix in EXTENSION_SUFFIXES:
        ext = stack.lookup(base + suffix.format(tag=tag))
        if ext is not None:
            return [ext]
    return []


def predict(stack: Any, path: str, data: bytes, extra_roots: Iterable[str] = (),
            imports: Sequence[Import] | None = None
            ) -> tuple[PycInfo | None, list[tuple[Any, Any]]]:
    """For the pyc at ``path`` with bytes ``data``: its module and the files the import system
    opens next, in order — its source (a checked-hash pyc is followed by an open of its
    ``.py``), then the files of each module it imports at module level (``scan``), looked up
    in the module's package (relative imports), its own root, the stdlib roots of its tag
    and ``extra_roots`` (other roots seen in the stack). Duplicates left out. ``imports``:
    ``scan(data)`` when the caller scanned already (an import index, ``pyindex``)."""
    info = pyc_info(stack, path)
    if info is None:
        return None, []
    out: list[tuple[Any, Any]] = []
    src = stack.lookup(info.source)
    if src is not None:
        out.append(src)
    std = stdlib_roots(info.tag)
    roots = list(dict.fromkeys([*std, info.root, *extra_roots]))
    tops: dict[str, str] = {}   # top-level name -> the root it was found in ("" : nowhere)
    frozen = FROZEN.get(info.tag, frozenset())
    parts = info.name.split(".")
    running = {".".join(parts[:k]) for k in range(1, len(parts) + 1)}  # imported already
    for imp in scan(data) if imports is None else imports:
        names = absolute_names(info, imp)
        for k, name in enumerate(names):
            if name in frozen or name in running:
                continue
            top = name.split(".", 1)[0]
            where = [info.root] if imp.level else (
                [tops[top]] if top in tops else roots)
            if where == [""]:
                break
            root, files = module_files(stack, where, name, info.tag, info.opt)
            if not imp.level and top not in tops:
                tops[top] = root
            if not files and k < len(names) - len(imp.fromlist):
                break   # a parent package is missing: nothing below it either
            out.extend(files)
    seen: set[tuple[int, int]] = set()
    uniq = []
    for ops, node in out:
        key = (id(ops), node.ino)
        if key not in seen:
            seen.add(key)
            uniq.append((ops, node))
    return info, uniq
