"""What a fetched ``.pyc`` will import (``runtime_shim.lazyfs.pydeps``): module-level imports
of pycs compiled here from real source (absolute, relative, ``from`` imports, try/except,
class bodies; function-level and ``TYPE_CHECKING`` imports left out), checked against
CPython's own ``marshal``/``dis`` view of the same pyc; and their resolution to files in a
stack of layer trees (package parents first, submodules of a fromlist, extension modules,
stdlib roots, frozen modules)."""

from __future__ import annotations

import dis
import importlib.util
import marshal
import py_compile
import stat
import sys
import textwrap
import types
from pathlib import Path

import pytest

from runtime_shim.lazyfs import pydeps, pystartup
from runtime_shim.lazyfs.elfdeps import Stack
from runtime_shim.lazyfs.pydeps import Import, absolute_names, predict, pyc_info, scan
from runtime_shim.lazyfs.tree import Node

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                                reason="the scanner reads CPython 3.11 pycs; the suite runs 3.11")


def compile_pyc(tmp_path: Path, source: str, name: str = "mod") -> bytes:
    src = tmp_path / f"{name}.py"
    src.write_text(textwrap.dedent(source))
    out = tmp_path / f"{name}.pyc"
    py_compile.compile(str(src), str(out), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    return out.read_bytes()


def test_the_opcodes_are_those_of_this_interpreter():
    assert importlib.util.MAGIC_NUMBER == pydeps._MAGIC_311
    for name, value in [("LOAD_CONST", pydeps._OP_LOAD_CONST), ("LOAD_NAME", pydeps._OP_LOAD_NAME),
                        ("LOAD_ATTR", pydeps._OP_LOAD_ATTR), ("LOAD_GLOBAL", pydeps._OP_LOAD_GLOBAL),
                        ("IMPORT_NAME", pydeps._OP_IMPORT_NAME),
                        ("EXTENDED_ARG", pydeps._OP_EXTENDED_ARG), ("CACHE", pydeps._OP_CACHE),
                        ("POP_JUMP_FORWARD_IF_FALSE", pydeps._OP_POP_JUMP_FORWARD_IF_FALSE)]:
        assert dis.opmap[name] == value, name


def test_module_level_imports_in_order_and_nothing_of_functions(tmp_path):
    data = compile_pyc(tmp_path, """
        import os, json.decoder
        from . import sibling
        from .. import cousin as c
        from .pkg.sub import a, b
        from collections import *
        try:
            import ujson
        except ImportError:
            ujson = None
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import only_for_typing
            from pandas import DataFrame
        import typing
        if typing.TYPE_CHECKING:
            import also_for_typing
        if os.name == "posix":
            import posix_only

        class K:
            import in_class_body
            def method(self):
                import in_method

        def f():
            import in_function
            from x import y
            return [__import__("z") for _ in ()]

        g = lambda: __import__("w")
        import last
        """)
    got = scan(data)
    assert got == [
        Import("os", 0, ()), Import("json.decoder", 0, ()), Import("", 1, ("sibling",)),
        Import("", 2, ("cousin",)), Import("pkg.sub", 1, ("a", "b")),
        Import("collections", 0, ()),          # from X import *: the names are unknown
        Import("ujson", 0, ()), Import("typing", 0, ("TYPE_CHECKING",)),
        Import("typing", 0, ()), Import("posix_only", 0, ()), Import("last", 0, ()),
        Import("in_class_body", 0, ())]


@pytest.mark.parametrize("module", ["json", "tokenize", "argparse", "inspect", "email.message",
                                    "logging", "dataclasses", "collections"])
def test_the_scan_agrees_with_cpythons_own_reading_of_real_modules(tmp_path, module):
    # a stdlib module compiled here; CPython's view (marshal.loads of our own pyc: trusted)
    # walked with dis over the module code and its class bodies
    source = Path(importlib.util.find_spec(module).origin).read_text()
    assert "TYPE_CHECKING" not in source
    data = compile_pyc(tmp_path, source, module.replace(".", "_"))
    code = marshal.loads(data[16:])
    expected, todo = [], [code]
    while todo:
        co = todo.pop(0)
        ins = list(dis.get_instructions(co))
        expected += [(i.argval, ins[k - 2].argval, ins[k - 1].argval or ())
                     for k, i in enumerate(ins) if i.opname == "IMPORT_NAME"]
        todo += [c for c in co.co_consts
                 if isinstance(c, types.CodeType) and not c.co_flags & 1]
    assert expected, module
    assert [(x.name, x.level, x.fromlist) for x in scan(data)] == [
        (n, lv, tuple(f for f in fl if f != "*")) for n, lv, fl in expected]


def test_other_versions_and_malformed_pycs_give_nothing(tmp_path):
    data = compile_pyc(tmp_path, "import os\n")
    assert scan(data) == [Import("os", 0, ())]
    assert scan(b"") == []
    assert scan(b"\x6f\x0d\x0d\x0a" + data[4:]) == []        # 3.10's magic
    assert scan(data[:-3]) == []                              # truncated
    assert scan(data[:16] + b"\xe9" + data[17:]) == []        # a list, not code, at the top
    assert scan(b"x" * (pydeps.MAX_PYC + 1)) == []


def _tree(files: list[str]) -> dict[str, Node]:
    nodes = {"": Node(1, stat.S_IFDIR | 0o755, 0, 0, 0, children={})}
    ino = 2
    for path in files:
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            d, parent = "/".join(parts[:i]), "/".join(parts[:i - 1])
            kids = nodes[parent].children
            assert kids is not None
            kids[parts[i - 1]] = None
            if d not in nodes and i < len(parts):
                nodes[d] = Node(ino, stat.S_IFDIR | 0o755, 0, 0, 0, children={})
                ino += 1
        nodes[path] = Node(ino, stat.S_IFREG | 0o644, 0, 0, 0, size=1, read_path=path)
        ino += 1
    return nodes


class Ops:
    def __init__(self, name: str, files: list[str]) -> None:
        self.name, self.lazy_nodes = name, _tree(files)


SP = "opt/venv/lib/python3.11/site-packages"
STD = "usr/lib/python3.11"
T = "cpython-311"


def _pair(d: str, name: str) -> list[str]:
    return [f"{d}/__pycache__/{name}.{T}.pyc", f"{d}/{name}.py"]


@pytest.fixture()
def stack():
    base = Ops("base", [*_pair(STD, "warnings"), *_pair(STD, "os"), *_pair(STD, "types"),
                        *_pair(f"{STD}/json", "__init__"), *_pair(f"{STD}/json", "decoder"),
                        f"{STD}/lib-dynload/_json.{T}-x86_64-linux-gnu.so"])
    venv = Ops("venv", [*_pair(f"{SP}/pkg", "__init__"), *_pair(f"{SP}/pkg", "version"),
                        *_pair(f"{SP}/pkg/core", "__init__"), *_pair(f"{SP}/pkg/core", "numeric"),
                        f"{SP}/pkg/core/_umath.{T}-x86_64-linux-gnu.so",
                        f"{SP}/pkg/core/_lim.abi3.so",
                        *_pair(f"{SP}/other", "__init__")])
    return Stack([venv, base])


def _names(files) -> list[str]:
    return [f"{ops.name}:{node.read_path}" for ops, node in files]


def test_a_pyc_is_a_module_of_its_root(stack):
    info = pyc_info(stack, f"{SP}/pkg/core/__pycache__/numeric.{T}.pyc")
    assert (info.name, info.root, info.is_package, info.source) == (
        "pkg.core.numeric", SP, False, f"{SP}/pkg/core/numeric.py")
    info = pyc_info(stack, f"{SP}/pkg/__pycache__/__init__.{T}.pyc")
    assert (info.name, info.root, info.is_package) == ("pkg", SP, True)
    assert pyc_info(stack, f"{SP}/pkg/version.py") is None
    assert absolute_names(info, Import("", 1, ("version", "core"))) == [
        "pkg", "pkg.version", "pkg.core"]
    assert absolute_names(info, Import("core.numeric", 1, ("x",))) == [
        "pkg", "pkg.core", "pkg.core.numeric", "pkg.core.numeric.x"]
    assert absolute_names(info, Import("", 2, ())) == []   # beyond the top-level package
    mod = pyc_info(stack, f"{SP}/pkg/core/__pycache__/numeric.{T}.pyc")
    assert absolute_names(mod, Import("", 2, ("version",))) == ["pkg", "pkg.version"]


def test_imports_resolve_to_their_files_across_layers(tmp_path, stack):
    data = compile_pyc(tmp_path, """
        import os, warnings, sys
        import json.decoder
        from . import version
        from .core import numeric, _umath, _lim, not_a_module
        from other import thing
        import missing.sub
        def f():
            import types
        """)
    info, files = predict(stack, f"{SP}/pkg/__pycache__/__init__.{T}.pyc", data)
    assert info.name == "pkg"
    assert _names(files) == [
        f"venv:{SP}/pkg/__init__.py",                       # its own source first
        # os is frozen in 3.11: never opened; sys is built in: no file
        f"base:{STD}/__pycache__/warnings.{T}.pyc", f"base:{STD}/warnings.py",
        f"base:{STD}/json/__pycache__/__init__.{T}.pyc", f"base:{STD}/json/__init__.py",
        f"base:{STD}/json/__pycache__/decoder.{T}.pyc", f"base:{STD}/json/decoder.py",
        f"venv:{SP}/pkg/__pycache__/version.{T}.pyc", f"venv:{SP}/pkg/version.py",
        f"venv:{SP}/pkg/core/__pycache__/__init__.{T}.pyc", f"venv:{SP}/pkg/core/__init__.py",
        f"venv:{SP}/pkg/core/__pycache__/numeric.{T}.pyc", f"venv:{SP}/pkg/core/numeric.py",
        f"venv:{SP}/pkg/core/_umath.{T}-x86_64-linux-gnu.so", f"venv:{SP}/pkg/core/_lim.abi3.so",
        f"venv:{SP}/other/__pycache__/__init__.{T}.pyc", f"venv:{SP}/other/__init__.py"]


def test_a_cached_stack_answers_as_the_stack(stack):
    cached = pydeps.CachedStack(stack, limit=2)
    for path in [f"{STD}/os.py", f"{STD}/nope.py", f"{STD}/os.py", f"{SP}/pkg/version.py"]:
        assert cached.lookup(path) == stack.lookup(path)
    assert len(cached.memo) <= 2


def test_an_interpreters_start_up_files_and_a_venvs_pth_files():
    base = Ops("base", ["usr/bin/python3.11", *_pair(f"{STD}/encodings", "__init__"),
                        *_pair(f"{STD}/encodings", "aliases"), *_pair(f"{STD}/encodings", "utf_8"),
                        *_pair(f"{STD}/encodings", "latin_1"), *_pair(STD, "sitecustomize"),
                        "usr/local/lib/python3.11/dist-packages/minicalc.pth",
                        "usr/local/lib/python3.11/dist-packages/README.txt"])
    venv = Ops("venv", ["opt/venv/pyvenv.cfg", f"{SP}/distutils-precedence.pth",
                        f"{SP}/a.pth", *_pair(f"{SP}/_distutils_hack", "__init__")])
    stack = Stack([venv, base])
    tag, sites, files = pystartup.startup_files(stack, "usr/bin/python3.11")
    assert tag == T and "usr/local/lib/python3.11/dist-packages" in sites
    assert _names(files) == [
        f"base:{STD}/encodings/__pycache__/__init__.{T}.pyc", f"base:{STD}/encodings/__init__.py",
        f"base:{STD}/encodings/__pycache__/aliases.{T}.pyc", f"base:{STD}/encodings/aliases.py",
        f"base:{STD}/encodings/__pycache__/utf_8.{T}.pyc", f"base:{STD}/encodings/utf_8.py",
        f"base:{STD}/__pycache__/sitecustomize.{T}.pyc", f"base:{STD}/sitecustomize.py",
        "base:usr/local/lib/python3.11/dist-packages/minicalc.pth"]
    tag, sites, files = pystartup.startup_files(stack, "opt/venv/pyvenv.cfg")
    assert (tag, sites) == (T, [SP])
    assert _names(files) == [f"venv:{SP}/a.pth", f"venv:{SP}/distutils-precedence.pth"]
    assert pystartup.startup_files(stack, "opt/venv/bin/pip") == ("", [], [])


def test_the_imports_of_a_pth_file():
    pth = (b"/workspace/src\n"
           b"import os; var = 'SETUPTOOLS_USE_DISTUTILS'; enabled = os.environ.get(var, 'local')"
           b" == 'local'; enabled and __import__('_distutils_hack').add_shim(); \n"
           b"import a_mod, b.sub as c\n#import commented\n  import indented\n")
    assert pystartup.pth_imports(pth) == ["os", "_distutils_hack", "a_mod", "b.sub", "indented"]
    assert pystartup.pth_imports(b"\xff\xfe garbage") == []
    assert pystartup.pth_imports(b"import x\n" * 10_000) == ["x"]
