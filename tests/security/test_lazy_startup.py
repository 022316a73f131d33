"""Attacks on the start-up hints (``runtime_shim.lazyfs.startup``, the daemon's ``startup``
request): a layer's names, symlinks and scripts, and a local client's request, are hostile.
Lookups stay inside the stack's trees (``..`` and absolute symlink targets are table keys,
resolved against the stack, never opened), loops and huge directories are bounded in steps,
files and bytes, and a malformed request is refused without taking the daemon down."""

from __future__ import annotations

import time

from runtime_shim.lazyfs import startup
from runtime_shim.lazyfs.control import daemon_request
from runtime_shim.lazyfs.elfdeps import Stack
from runtime_shim.lazyfs.startup import command_file, shebang, startup_files
from tests.lazy_daemon import bare_daemon
from tests.unit.test_lazy_startup import Ops, _paths


def test_symlinks_cannot_leave_the_stack_and_loops_end():
    evil = Ops("evil", {
        "etc/passwd": "../../../../../../etc/shadow",      # resolves inside the stack
        "etc/shadow": 10,
        "etc/group": "/etc/group",                          # a loop onto itself
        "etc/localtime": "a", "a": "b", "b": "a",           # a longer loop
        "usr/local/bin/tool": "/usr/local/bin/tool",
    })
    hits = startup_files(Stack([evil]), {"LANG": "C.UTF-8", "PATH": "/usr/local/bin"})
    # the passwd symlink names the stack's own etc/shadow (a file of the layer, as the
    # container would read it): nothing outside the trees is ever a candidate
    assert _paths(hits) == [("evil", "etc/shadow")]
    assert command_file(Stack([evil]), {"PATH": "/usr/local/bin"}, "tool") is None


def test_huge_directories_paths_and_lines_stay_bounded():
    locale = {f"usr/lib/locale/C.utf8/F{i}": 1 for i in range(20_000)}
    locale.update({f"usr/lib/locale/C.utf8/LC_MESSAGES/M{i}": 1 for i in range(20_000)})
    stack = Stack([Ops("big", locale)])
    t0 = time.monotonic()
    hits = startup_files(stack, {"LANG": "C.UTF-8"})
    assert len(hits) <= startup.MAX_LOCALE_FILES and time.monotonic() - t0 < 5
    env = {"PATH": ":".join(f"/d{i}" for i in range(100_000))}
    t0 = time.monotonic()
    assert command_file(stack, env, "x") is None and time.monotonic() - t0 < 1
    assert command_file(stack, env, "a" * 100_000) is None
    assert len(shebang(b"#!/" + b"a" * (1 << 20))) < startup.SHEBANG_MAX


def test_a_malformed_startup_request_is_refused_and_the_daemon_serves_on(tmp_path):
    node = tmp_path / "node"
    with bare_daemon(node):
        for bad in ({"mountpoints": "x", "env": {}}, {"mountpoints": [], "env": []},
                    {"mountpoints": [1] * 2000, "env": {}},
                    {"mountpoints": [], "env": {}, "cmd": "sh"}):
            reply = daemon_request(node, {"op": "startup", **bad}, 10)
            assert reply is not None and reply["ok"] is False, (bad, reply)
        # unknown mount points, non-string values: accepted, nothing to fetch
        reply = daemon_request(node, {"op": "startup", "mountpoints": [str(tmp_path), 7],
                                      "env": {"LANG": 3, "TZ": "../../x"},
                                      "cmd": [{"a": 1}]}, 10)
        assert reply == {"ok": True, "layers": 0}
        assert daemon_request(node, {"op": "ping"}, 10)["ok"] is True
