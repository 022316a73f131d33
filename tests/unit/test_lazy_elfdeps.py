"""What a fetched program's loader opens next (``runtime_shim.lazyfs.elfdeps``): the ELF
interpreter and needed libraries of a hand-made ELF image, looked up in a stack of layer
trees the way the sandbox's overlay shows them; malformed ELF bytes and hostile trees
(symlink loops, ``..``) bounded and harmless."""

from __future__ import annotations

import stat
import struct

import pytest

from runtime_shim.lazyfs.elfdeps import LOADER_CACHE, MAX_PHDRS, Stack, parse
from runtime_shim.lazyfs.tree import Node


def elf(interp: str = "", needed: tuple[str, ...] = (), *, strtab_vaddr: int = 0x100000,
        load: bool = True, phnum: int | None = None,
        run: tuple[tuple[int, str], ...] = ()) -> bytes:
    """A 64-bit little-endian ELF: header, program headers (PT_INTERP, PT_LOAD over the whole
    image, PT_DYNAMIC), the dynamic entries (``run``: more ``(tag, string)`` ones, e.g.
    ``DT_RUNPATH``) and their string table."""
    strings = b"\0"
    offsets = []
    for name in needed:
        offsets.append(len(strings))
        strings += name.encode() + b"\0"
    extra = []
    for tag, text in run:
        extra.append((tag, len(strings)))
        strings += text.encode() + b"\0"
    interp_b = interp.encode() + b"\0" if interp else b""
    phdrs = (1 if interp else 0) + (1 if load else 0) + 1
    phoff = 64
    interp_off = phoff + phdrs * 56
    dyn_off = interp_off + len(interp_b)
    dyn = b"".join(struct.pack("<qQ", 1, o) for o in offsets)
    dyn += b"".join(struct.pack("<qQ", tag, o) for tag, o in extra)
    dyn += struct.pack("<qQ", 5, strtab_vaddr) + struct.pack("<qQ", 0, 0)
    str_off = dyn_off + len(dyn)
    total = str_off + len(strings)
    ph = b""
    if interp:
        ph += struct.pack("<IIQQQQQQ", 3, 4, interp_off, 0, 0, len(interp_b), len(interp_b), 1)
    if load:  # file offset str_off is at vaddr strtab_vaddr
        ph += struct.pack("<IIQQQQQQ", 1, 5, 0, strtab_vaddr - str_off, 0, total, total, 4096)
    ph += struct.pack("<IIQQQQQQ", 2, 6, dyn_off, 0, 0, len(dyn), len(dyn), 8)
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", head, 0x20, phoff)
    struct.pack_into("<HH", head, 0x36, 56, phdrs if phnum is None else phnum)
    return bytes(head) + ph + interp_b + dyn + strings


def test_parse_reads_the_interpreter_and_the_needed_libraries():
    data = elf("/lib64/ld-linux-x86-64.so.2", ("libm.so.6", "libc.so.6"))
    assert parse(data) == ("/lib64/ld-linux-x86-64.so.2", ["libm.so.6", "libc.so.6"])
    assert parse(elf(needed=("libc.so.6",))) == ("", ["libc.so.6"])
    assert parse(elf("/ld.so")) == ("/ld.so", [])


@pytest.mark.parametrize("data", [
    b"", b"#!/bin/sh\n", b"\x7fELF" + b"\0" * 60,                 # not a 64-bit LE ELF
    elf("/ld.so", ("libc.so.6",))[:100],                           # truncated
    elf("/ld.so", ("libc.so.6",), phnum=MAX_PHDRS + 1),            # too many headers
    elf("/ld.so", ("libc.so.6",), phnum=0xFFFF),
])
def test_parse_of_anything_else_is_nothing_and_never_raises(data):
    interp, needed = parse(data)
    assert needed == [] and interp in ("", "/ld.so")


def test_names_outside_the_image_or_with_a_slash_are_dropped():
    assert parse(elf("/ld.so", ("libc.so.6",), load=False)) == ("/ld.so", [])  # no PT_LOAD
    assert parse(elf("/ld.so", ("libc.so.6",), strtab_vaddr=1 << 40))[1] == ["libc.so.6"]
    assert parse(elf("", ("../../etc/passwd", "libz.so.1"))) == ("", ["libz.so.1"])
    big = elf("", tuple(f"lib{i}.so" for i in range(500)))
    assert len(parse(big)[1]) == 64   # MAX_NAMES


def _tree(files: dict[str, object]) -> dict[str, Node]:
    """A layer tree: a ``str`` value is a symlink target, ``None`` a whiteout, else a file."""
    nodes = {"": Node(1, stat.S_IFDIR | 0o755, 0, 0, 0, children={})}
    ino = 2
    for path, what in files.items():
        parts = path.split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d not in nodes:
                nodes[d] = Node(ino, stat.S_IFDIR | 0o755, 0, 0, 0, children={})
                ino += 1
        if isinstance(what, str):
            nodes[path] = Node(ino, stat.S_IFLNK | 0o777, 0, 0, 0, link=what)
        elif what is None:
            nodes[path] = Node(ino, stat.S_IFCHR | 0o600, 0, 0, 0)
        else:
            nodes[path] = Node(ino, stat.S_IFREG | 0o644, 0, 0, 0, size=1, read_path=path)
        ino += 1
    return nodes


class Ops:
    def __init__(self, name: str, files: dict[str, object]) -> None:
        self.name, self.lazy_nodes = name, _tree(files)


def _found(hit) -> tuple[str, str] | None:
    return None if hit is None else (hit[0].name, hit[1].read_path)


def test_lookups_follow_symlinks_across_layers_and_the_top_layer_wins():
    base = Ops("base", {"lib": "usr/lib", "lib64": "usr/lib64",
                        "usr/lib64/ld-linux-x86-64.so.2": "../lib/x86_64-linux-gnu/ld-2.so",
                        "usr/lib/x86_64-linux-gnu/ld-2.so": 1,
                        "usr/lib/x86_64-linux-gnu/libc.so.6": 1,
                        "usr/lib/x86_64-linux-gnu/libz.so.1": "libz.so.1.2",
                        "usr/lib/x86_64-linux-gnu/libz.so.1.2": 1,
                        "usr/lib/x86_64-linux-gnu/libgone.so": 1,
                        "etc/ld.so.cache": 1})
    top = Ops("top", {"usr/lib/x86_64-linux-gnu/libc.so.6": 1,      # replaces the base's
                      "usr/lib/x86_64-linux-gnu/libgone.so": None,  # a whiteout
                      "opt/app/libz.so.1.2": 1})
    stack = Stack([top, base])
    assert _found(stack.lookup("/lib64/ld-linux-x86-64.so.2")) == (
        "base", "usr/lib/x86_64-linux-gnu/ld-2.so")
    assert _found(stack.lookup("lib/x86_64-linux-gnu/libc.so.6")) == (
        "top", "usr/lib/x86_64-linux-gnu/libc.so.6")
    assert stack.lookup("usr/lib/x86_64-linux-gnu/libgone.so") is None
    assert stack.lookup("usr/lib") is None       # a directory is no file
    deps = stack.dependencies(elf("/lib64/ld-linux-x86-64.so.2",
                                  ("libz.so.1", "libc.so.6", "libmissing.so", "libgone.so")))
    assert [_found(h) for h in deps] == [
        ("base", "usr/lib/x86_64-linux-gnu/ld-2.so"), ("base", LOADER_CACHE),
        ("base", "usr/lib/x86_64-linux-gnu/libz.so.1.2"),
        ("top", "usr/lib/x86_64-linux-gnu/libc.so.6")]
    # an interpreter alone (a large program's first bytes: its dynamic section comes later)
    # means the loader and its cache; no interpreter and no needed libraries: nothing
    assert stack.dependencies(elf("/lib64/ld-linux-x86-64.so.2")) == [
        stack.lookup("lib64/ld-linux-x86-64.so.2"), stack.lookup("etc/ld.so.cache")]
    assert stack.dependencies(elf("")) == []


def test_symlink_loops_and_dotdot_stay_bounded_and_inside_the_trees():
    ops = Ops("l", {"a": "b", "b": "a", "c": "/../../../c", "d/e": "../../../../etc/x",
                    "etc/x": 1, "self": "self/x"})
    stack = Stack([ops])
    assert stack.lookup("a") is None and stack.lookup("self") is None
    assert stack.lookup("c") is None            # resolves to itself from the root, a loop
    assert _found(stack.lookup("d/e")) == ("l", "etc/x")   # ".." stops at the root
    assert stack.lookup("") is None and stack.lookup("/") is None
    # a walk is bounded in components (MAX_STEPS; a real path is at most PATH_MAX bytes)
    deep = "/".join(["d"] * 3000)
    around = deep + "/.." * 1000 + "/" + "/".join(["d"] * 1000) + "/x"   # = deep/x
    ops = Ops("deep", {f"{deep}/x": 1, "near": f"{deep}/../d/x", "around": around})
    assert _found(Stack([ops]).lookup("near")) == ("deep", f"{deep}/x")
    assert Stack([ops]).lookup("around") is None   # 5,000 components: past the bound


def _walked(stack: Stack, path: str):
    """The reference: a full walk of ``path`` from the root (what ``lookup`` did before it
    remembered directories)."""
    got = stack._walk(path.split("/"))
    return got[1] if got is not None and stat.S_ISREG(got[1][1].mode) else None


def test_remembered_directories_give_what_a_full_walk_gives():
    """``lookup`` resolves a path's directory once and remembers it (an import closure asks
    for ~16,000 paths): over random stacks of dirs, files, whiteouts and symlinks (to dirs,
    files, up the tree, absolute, dangling, in loops), every plain path resolves as a walk
    from the root does, asked in any order and twice. (A file in an upper layer hides a
    lower directory of its name: nothing below it is found, as in the overlay.)"""
    import random

    rng = random.Random(1311)
    names = ["a", "b", "c", "lib", "x.py", "y.so"]
    for _ in range(60):
        layers = []
        for k in range(rng.randint(1, 3)):
            files: dict[str, object] = {}
            for _ in range(rng.randint(3, 25)):
                path = "/".join(rng.choice(names) for _ in range(rng.randint(1, 4)))
                r = rng.random()
                files[path] = (None if r < 0.1 else
                               rng.choice(["a", "b/c", "../a", "/lib", "..", "nowhere",
                                           "a/../b", path.rpartition("/")[0] or "."])
                               if r < 0.35 else 1)
            # a tree: no entry where another one needs a directory
            files = {p: v for p, v in files.items()
                     if not any(q.startswith(p + "/") for q in files)}
            layers.append(Ops(f"l{k}", files))
        stack = Stack(layers)
        paths = ["/".join(rng.choice(names) for _ in range(rng.randint(1, 5)))
                 for _ in range(80)]
        for path in paths + paths[::-1]:
            assert _found(stack.lookup(path)) == _found(_walked(stack, path)), path


def test_needed_libraries_are_found_in_the_run_path_with_origin_first():
    """An extension module's libraries sit where its ``DT_RUNPATH`` says, ``$ORIGIN``
    relative (numpy's ``numpy.libs``): they are found there before the loader's directories;
    ``DT_RPATH`` counts when there is no ``DT_RUNPATH``; ``$ORIGIN`` without the file's
    path, other ``$`` tokens and relative entries are skipped, and ``..`` stops at the
    root."""
    from runtime_shim.lazyfs.elfdeps import parse_dynamic

    site = "opt/venv/lib/python3.11/site-packages"
    ops = Ops("venv", {f"{site}/numpy.libs/libopenblas.so": 1,
                       "usr/lib/x86_64-linux-gnu/libopenblas.so": 1,
                       "usr/lib/x86_64-linux-gnu/libm.so.6": 1, "opt/x/libq.so": 1,
                       "libroot.so": 1})
    stack = Stack([ops])
    runpath, rpath = 29, 15
    module = elf("", ("libopenblas.so", "libm.so.6"),
                 run=((runpath, "$ORIGIN/../../numpy.libs:/opt/x"),))
    assert parse_dynamic(module)[2] == ["$ORIGIN/../../numpy.libs", "/opt/x"]
    origin = f"{site}/numpy/core/_umath.so"
    assert [_found(h)[1] for h in stack.dependencies(module, origin)] == [
        f"{site}/numpy.libs/libopenblas.so", "usr/lib/x86_64-linux-gnu/libm.so.6"]
    assert [_found(h)[1] for h in stack.dependencies(module)] == [   # no path: no $ORIGIN
        "usr/lib/x86_64-linux-gnu/libopenblas.so", "usr/lib/x86_64-linux-gnu/libm.so.6"]
    both = elf("", ("libq.so",), run=((rpath, "/nowhere"), (runpath, "${ORIGIN}/../x")))
    assert [_found(h)[1] for h in stack.dependencies(both, "opt/bin/prog")] == ["opt/x/libq.so"]
    old = elf("", ("libq.so",), run=((rpath, "$LIB/x:x:/opt/x"),))
    assert [_found(h)[1] for h in stack.dependencies(old, "p")] == ["opt/x/libq.so"]
    up = elf("", ("libroot.so",), run=((runpath, "$ORIGIN/../../../../.."),))
    assert [_found(h)[1] for h in stack.dependencies(up, "a/b")] == ["libroot.so"]
