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


def test_pythons_start_up_hints_stay_bounded():
    """A layer of 50,000 venvs, a ``python3`` that loops, a ``pyvenv.cfg`` that is a symlink out
    of the stack or a whiteout: the create's Python start-up lookups (``venv_configs``,
    ``command_file``) take a bounded number of venvs, at bounded depth, in bounded time, and
    resolve nothing outside the trees."""
    venvs = {f"v{i}/pyvenv.cfg": 10 for i in range(50_000)}
    venvs.update({"opt/venv/pyvenv.cfg": "/../../../../etc/shadow",   # a table key, in-stack
                  "etc/shadow": 5,
                  "srv/gone/pyvenv.cfg": None,                        # a whiteout
                  "/".join(["d"] * 40) + "/pyvenv.cfg": 10,           # too deep
                  "usr/bin/python3": "python3.11", "usr/bin/python3.11": "python3"})   # a loop
    layer = Ops("evil", venvs)
    t0 = time.monotonic()
    found = startup.venv_configs([layer])
    assert len(found) == startup.MAX_VENVS and time.monotonic() - t0 < 2
    assert all(p.count("/") < startup.VENV_DEPTH for p in found)
    stack = Stack([layer])
    assert command_file(stack, {"PATH": "/usr/bin"}, "python3") is None   # the loop ends
    hit = stack.lookup("opt/venv/pyvenv.cfg")
    assert hit is not None and hit[1].read_path == "etc/shadow"   # the stack's own file
    assert stack.lookup("srv/gone/pyvenv.cfg") is None
