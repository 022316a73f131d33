"""``metalayer.plan`` (pure): which inodes of a layer's tree go into its meta tree, with what."""

from __future__ import annotations

import stat

from envbuild.layers import Entry
from runtime_shim.lazyfs import metalayer
from runtime_shim.lazyfs.tree import build_tree

A, B, C = ("sha256:" + c * 64 for c in "abc")


def _plan(entries, present):
    nodes = build_tree(entries)
    by = {e.path: e.digest for e in entries if e.type == "file"}
    return metalayer.plan(nodes, lambda n: by.get(n.read_path, ""), present)


def test_only_present_regular_files_with_their_parents():
    dirs, files = _plan([
        Entry("usr", "dir", mode=0o755, uid=1, gid=2, mtime=5, xattrs={"user.d": b"1"}),
        Entry("usr/lib/x.so", "file", size=3, digest=A, mode=0o755, mtime=7),
        Entry("usr/lib/y.so", "file", size=4, digest=B),
        Entry("usr/bin/sh", "symlink", linkname="busybox"),
        Entry("etc/.wh.passwd", "file"),
        Entry("tmp/fifo", "fifo"),
    ], {A})
    assert [f.paths for f in files] == [("usr/lib/x.so",)]
    assert (files[0].size, files[0].mode, files[0].mtime, files[0].digest) == (3, 0o755, 7, A)
    assert [d.paths[0] for d in dirs] == ["", "usr", "usr/lib"]  # parents first
    usr = dirs[1]
    assert (usr.mode, usr.uid, usr.gid, usr.mtime, usr.xattrs) == (0o755, 1, 2, 5,
                                                                   (("user.d", b"1"),))


def test_hardlinks_are_one_entry_with_every_name():
    _dirs, files = _plan([Entry("a", "file", size=1, digest=C),
                          Entry("b", "hardlink", linkname="a"),
                          Entry("d/c", "hardlink", linkname="a")], {C})
    assert [sorted(f.paths) for f in files] == [["a", "b", "d/c"]]


def test_overlay_xattrs_and_unsafe_names_are_left_out():
    entries = [
        Entry("o", "dir", xattrs={"trusted.overlay.opaque": b"y", "security.x": b"s"}),
        Entry("o/.wh..wh..opq", "file"),
        Entry("o/f", "file", size=1, digest=A, xattrs={
            "trusted.overlay.redirect": b"/" + B[7:].encode(), "user.k": b"v"}),
        Entry("g", "file", size=1, digest=A),
    ]
    nodes = build_tree(entries)
    # the tree refuses unsafe member names itself (test_lazy_tree); the plan must not rely on
    # it: names no TOC could give are put into the table by hand
    nodes["a/../../x"] = nodes["n" * 256] = nodes.pop("g")
    by = {e.path: e.digest for e in entries if e.type == "file"}
    dirs, files = metalayer.plan(nodes, lambda n: by.get(n.read_path, ""), {A, B})
    assert [f.paths for f in files] == [("o/f",)]
    assert files[0].xattrs == (("user.k", b"v"),)
    assert [d.xattrs for d in dirs if d.paths == ("o",)] == [(("security.x", b"s"),)]
    assert not any(stat.S_ISCHR(f.mode) for f in files)


def test_safe_path():
    assert metalayer.safe_path("a/b.c/d")
    for bad in ("", "a//b", "./a", "a/..", "a/\0", "x" * 256, "/".join(["d"] * 2000)):
        assert not metalayer.safe_path(bad), bad


def _slow_daemon(monkeypatch, reply):
    """``daemon_request`` replaced by one that records each request and answers ``reply``
    only once released (a daemon busy with the mounts it just made)."""
    import threading

    from runtime_shim.lazyfs import control

    calls, release = [], threading.Event()

    def request(root, req, timeout):
        calls.append(req)
        release.wait(5)
        return reply

    monkeypatch.setattr(control, "daemon_request", request)
    return calls, release


def test_a_stack_with_no_generation_on_disk_is_answered_without_waiting(tmp_path, monkeypatch):
    import time

    calls, release = _slow_daemon(monkeypatch, {"layers": []})
    t0 = time.monotonic()
    try:
        assert metalayer.meta_dirs(tmp_path, [(A, "/mp/a"), (B, "/mp/b")]) == ["", ""]
        assert time.monotonic() - t0 < 2   # the daemon's answer was not waited for
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        # the request still went (it may start a build that is due, for the next create)
        assert [x["digest"] for x in calls[0]["layers"]] == [A, B]
    finally:
        release.set()


def test_a_layer_with_a_generation_on_disk_waits_for_the_daemon_answer(tmp_path, monkeypatch):
    gen = tmp_path / "meta" / B.removeprefix("sha256:") / "g-0123456789abcdef" / "mnt"
    gen.mkdir(parents=True)
    monkeypatch.setattr(metalayer, "_is_mount", lambda p: p == str(gen))  # no mounts here
    calls, release = _slow_daemon(monkeypatch, {"layers": [
        {"digest": A, "dir": ""}, {"digest": B, "dir": str(gen)}]})
    release.set()
    assert metalayer.meta_dirs(tmp_path, [(A, "/mp/a"), (B, "/mp/b")]) == ["", str(gen)]
    assert len(calls) == 1
