"""The start-up files of a stack (``runtime_shim.lazyfs.startup``): which files runc and a
program's libc start-up read under a lock's environment, looked up in fake layer trees (top
layer first, whiteouts and symlinks as the overlay sees them), with hostile names bounded."""

from __future__ import annotations

import stat

from runtime_shim.lazyfs import startup
from runtime_shim.lazyfs.elfdeps import Stack
from runtime_shim.lazyfs.startup import locale_dirs, locale_of, startup_files, zone_file
from runtime_shim.lazyfs.tree import Node


class Ops:
    """A layer: ``files`` maps a path to a size (a file), a ``str`` (a symlink) or None (a
    whiteout); directories are made with their children."""

    def __init__(self, name: str, files: dict[str, object]) -> None:
        self.name = name
        self.lazy_nodes = {"": Node(1, stat.S_IFDIR | 0o755, 0, 0, 0, children={})}
        for path, what in files.items():
            parts = path.split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in self.lazy_nodes:
                    self._add(d, Node(0, stat.S_IFDIR | 0o755, 0, 0, 0, children={}))
            if isinstance(what, str):
                node = Node(0, stat.S_IFLNK | 0o777, 0, 0, 0, link=what)
            elif what is None:
                node = Node(0, stat.S_IFCHR | 0o600, 0, 0, 0)
            else:
                node = Node(0, stat.S_IFREG | 0o644, 0, 0, 0, size=int(what), read_path=path)
            self._add(path, node)

    def _add(self, path: str, node: Node) -> None:
        self.lazy_nodes[path] = node
        parent = self.lazy_nodes[path.rpartition("/")[0]]
        assert parent.children is not None
        parent.children[path.rpartition("/")[2]] = None


def _paths(hits) -> list[tuple[str, str]]:
    return [(ops.name, node.read_path) for ops, node in hits]


BASE = Ops("base", {
    "etc/passwd": 800, "etc/group": 400, "etc/localtime": "/usr/share/zoneinfo/Etc/UTC",
    "usr/share/zoneinfo/Etc/UTC": 114, "usr/share/zoneinfo/Europe/Paris": 2000,
    "usr/lib/locale/C.utf8/LC_CTYPE": 350_000, "usr/lib/locale/C.utf8/LC_TIME": 3000,
    "usr/lib/locale/C.utf8/LC_MESSAGES/SYS_LC_MESSAGES": 48,
    "usr/lib/locale/de_DE.utf8/LC_CTYPE": 1000,
    "usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache": 27_000,
    "usr/lib/x86_64-linux-gnu/libc.so.6": 2_000_000,
})


def test_the_environment_names_the_locale_and_the_zone_as_glibc_reads_them():
    assert locale_of({"LANG": "C.UTF-8"}) == "C.UTF-8"
    assert locale_of({"LANG": "C.UTF-8", "LC_CTYPE": "de_DE.UTF-8"}) == "de_DE.UTF-8"
    assert locale_of({"LANG": "C.UTF-8", "LC_ALL": "POSIX"}) == ""   # built in: no file
    for bad in ("", "C", "../../etc", "a/b", "x" * 200, "de\0DE"):
        assert locale_of({"LANG": bad}) == ""
    assert locale_dirs("C.UTF-8") == ["C.utf8", "C.UTF-8"]
    assert locale_dirs("en_US.ISO-8859-1@euro") == ["en_US.iso88591@euro",
                                                    "en_US.ISO-8859-1@euro"]
    assert locale_dirs("de_DE.utf8") == ["de_DE.utf8"] and locale_dirs("de_DE") == ["de_DE"]
    assert zone_file({}) == "etc/localtime"
    assert zone_file({"TZ": ":Europe/Paris"}) == "usr/share/zoneinfo/Europe/Paris"
    assert zone_file({"TZ": "/etc/myzone"}) == "etc/myzone"
    assert zone_file({"TZ": "../../etc/shadow"}) == "" and zone_file({"TZ": ""}) == ""


def test_the_start_up_files_of_a_stack():
    hits = startup_files(Stack([BASE]), {"LANG": "C.UTF-8"})
    assert _paths(hits) == [
        ("base", "etc/passwd"), ("base", "etc/group"),
        ("base", "usr/lib/locale/C.utf8/LC_CTYPE"), ("base", "usr/lib/locale/C.utf8/LC_TIME"),
        ("base", "usr/lib/locale/C.utf8/LC_MESSAGES/SYS_LC_MESSAGES"),
        ("base", "usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache"),
        ("base", "usr/share/zoneinfo/Etc/UTC")]       # /etc/localtime's target
    # no locale (C): no locale files, no gconv cache; $TZ names the zone
    assert _paths(startup_files(Stack([BASE]), {"TZ": "Europe/Paris"})) == [
        ("base", "etc/passwd"), ("base", "etc/group"),
        ("base", "usr/share/zoneinfo/Europe/Paris")]


def test_upper_layers_replace_hide_and_redirect():
    upper = Ops("upper", {"etc/passwd": 900, "etc/group": None,        # replaced, deleted
                          "usr/lib/locale/C.utf8/LC_TIME": None,
                          "etc/localtime": "../usr/share/zoneinfo/Europe/Paris"})
    hits = _paths(startup_files(Stack([upper, BASE]), {"LANG": "C.UTF-8"}))
    assert ("upper", "etc/passwd") in hits and ("base", "etc/passwd") not in hits
    assert not any(p == "etc/group" for _, p in hits)
    assert not any(p.endswith("LC_TIME") for _, p in hits)
    assert ("base", "usr/share/zoneinfo/Europe/Paris") in hits


def test_a_hostile_stack_stays_bounded():
    many = {f"usr/lib/locale/C.utf8/LC_{i}": 10 for i in range(500)}
    many["usr/lib/locale/C.utf8/LC_HUGE"] = 1 << 40
    many["etc/localtime"] = "/etc/localtime"                        # a loop
    hits = startup_files(Stack([Ops("h", many)]), {"LANG": "C.UTF-8"})
    assert len(hits) <= startup.MAX_LOCALE_FILES
    assert sum(n.size for _, n in hits) <= startup.MAX_BYTES


def test_the_lock_command_is_found_as_execvp_finds_it_and_scripts_name_their_interpreter():
    from runtime_shim.lazyfs.startup import command_file, shebang

    top = Ops("top", {"opt/tool/bin/pytest": "../venv/bin/pytest", "opt/tool/venv/bin/pytest": 242,
                      "opt/tool/venv/bin/python3": "/usr/bin/python3"})
    base = Ops("base", {"usr/bin/python3": "python3.11", "usr/bin/python3.11": 6_800_000,
                        "usr/bin/pytest": 10})
    stack = Stack([top, base])
    env = {"PATH": "/opt/tool/bin:/usr/bin"}
    assert _paths([command_file(stack, env, "pytest")]) == [("top", "opt/tool/venv/bin/pytest")]
    assert _paths([command_file(stack, env, "/opt/tool/venv/bin/python3")]) == [
        ("base", "usr/bin/python3.11")]
    assert command_file(stack, {"PATH": "relative:/nowhere"}, "pytest") is None
    assert command_file(stack, env, "") is None and command_file(stack, env, "a\0b") is None
    assert shebang(b"#!/opt/tool/venv/bin/python3\n# -*- coding\n") == "/opt/tool/venv/bin/python3"
    assert shebang(b"#! /usr/bin/env -S python3 -u\n") == "python3"
    assert shebang(b"\x7fELF...") == "" and shebang(b"#!\n") == "" and shebang(b"#!/usr/bin/env\n") == ""
    assert len(shebang(b"#!/" + b"x" * 10_000)) < 256   # the kernel's bound
