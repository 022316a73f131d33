"""Attacks on meta layers (``runtime_shim.lazyfs.metalayer``) through a hostile layer's TOC, on
the real kernel: the TOC goes through ``build_tree`` (what the daemon serves), the meta tree is
built on disk and mounted as the read-only metacopy overlay a sandbox would stack.

- names that try to leave the tree (``..``, ``.``, empty components, NUL, 300-byte names, a
  path past ``MAX_PATH``) never create anything outside it, and are left to the FUSE mount;
- ``trusted.overlay.*`` xattrs in the TOC (a redirect to another file's content, metacopy,
  opaque) are never copied: each file shows its own verified bytes;
- a lower layer whose root holds a file named like a digest cannot stand in for the data of
  a layer above it (the redirect is resolved inside the inner overlay only);
- a cache file that is a symlink, or of the wrong size, is not used;
- 100,000 fetched files are built in bounded time.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from envbuild.errors import UnsafeLayerError
from envbuild.layers import Entry
from runtime_shim.isolation.mount import mounted_targets_under, unmount
from runtime_shim.lazyfs import metalayer
from runtime_shim.lazyfs.tree import build_tree
from tests.conftest import require_root


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _mount(root: Path) -> None:
    metalayer.mount_generation(str(root / "tree"), str(root / "data"), str(root / "mnt"))


@pytest.fixture
def gen(tmp_path):
    """A generation dir (``tree`` on a tmpfs as on a node, ``data``, ``mnt``) and a file cache
    dir; unmounted after."""
    require_root()
    root = tmp_path / "g"
    for sub in ("tree", "data", "mnt"):
        (root / sub).mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", metalayer.TREES_OPTIONS, "meta-test",
                    str(root / "tree")], check=True)
    files = tmp_path / "files"
    files.mkdir()
    yield root, files
    unmount(str(root / "mnt"))
    unmount(str(root / "tree"))
    assert mounted_targets_under(str(tmp_path)) == []


def _make(root: Path, files: Path, entries: list[Entry], contents: dict[str, bytes],
          inject: dict[str, str] | None = None) -> int:
    """Build and mount the meta layer of ``entries``; ``inject`` puts more names into the
    inode table by hand (name -> an existing path whose node it gets): names the TOC decoder
    refuses itself, to test the meta layer's own checks."""
    for digest, data in contents.items():
        p = files / digest.removeprefix("sha256:")
        if not p.exists():
            p.write_bytes(data)
    nodes = build_tree(entries)
    for name, existing in (inject or {}).items():
        nodes[name] = nodes[existing]
    by_path = {e.path.strip("/"): e.digest for e in entries if e.type == "file"}

    def digest_of(node):
        return by_path.get(node.read_path, "") or ""

    dirs, fl = metalayer.plan(nodes, digest_of, set(contents))
    placed = metalayer.build(str(root / "tree"), str(root / "data"), dirs, fl,
                             lambda h: [str(files / h)])
    _mount(root)
    return placed


def test_hostile_names_stay_inside_the_tree(gen, tmp_path):
    root, files = gen
    data = b"payload\n"
    d = _digest(data)
    bad = ["a/../../escape", "../up", "b/./x", "c//y", "nul\0byte", "n" * 300,
           "/".join(["deep"] * 700) + "/f"]
    good = Entry("good/file", "file", size=len(data), digest=d, mode=0o640, uid=7, gid=8,
                 mtime=1_600_000_000)
    for p in bad[:4]:  # the TOC decoder refuses what unpack refuses
        with pytest.raises(UnsafeLayerError):
            build_tree([Entry(p, "file", size=len(data), digest=d), good])
    entries = [Entry(p, "file", size=len(data), digest=d) for p in bad[4:]]
    entries.append(good)
    before = sorted(os.listdir(tmp_path))
    # the meta layer checks every name again: the refused ones are put in by hand
    placed = _make(root, files, entries, {d: data}, inject={p: "good/file" for p in bad[:4]})
    assert placed == 1
    assert sorted(os.listdir(tmp_path)) == before  # nothing next to the generation
    walked = sorted(str(p.relative_to(root / "tree")) for p in (root / "tree").rglob("*"))
    assert walked == ["good", "good/file"]
    st = os.stat(root / "mnt" / "good" / "file")
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_mtime) == (0o640, 7, 8,
                                                                        1_600_000_000)
    assert (root / "mnt" / "good" / "file").read_bytes() == data
    assert not (tmp_path / "escape").exists() and not (root / "up").exists()


def test_toc_overlay_xattrs_are_not_copied(gen):
    root, files = gen
    mine, secret = b"my own bytes\n", b"another tenant's file\n"
    dm, ds = _digest(mine), _digest(secret)
    (files / ds.removeprefix("sha256:")).write_bytes(secret)  # on the node, not in this layer
    entries = [
        Entry("d", "dir", mode=0o755, xattrs={"trusted.overlay.opaque": b"y",
                                              "trusted.overlay.redirect": b"/elsewhere",
                                              "user.kept": b"1"}),
        Entry("d/f", "file", size=len(mine), digest=dm, xattrs={
            "trusted.overlay.redirect": b"/" + ds.removeprefix("sha256:").encode(),
            "trusted.overlay.metacopy": b"", "user.note": b"x"}),
    ]
    assert _make(root, files, entries, {dm: mine}) == 1
    f = root / "mnt" / "d" / "f"
    assert f.read_bytes() == mine  # its own digest, not the redirect the TOC asked for
    assert os.getxattr(f, "user.note") == b"x"
    assert os.getxattr(root / "mnt" / "d", "user.kept") == b"1"
    for p in (root / "tree" / "d", root / "tree" / "d" / "f"):
        names = os.listxattr(p)
        assert "trusted.overlay.opaque" not in names
        if p.name == "d":
            assert "trusted.overlay.redirect" not in names
    assert os.getxattr(root / "tree" / "d" / "f", "trusted.overlay.redirect") == \
        b"/" + dm.removeprefix("sha256:").encode()


def test_a_lower_layers_digest_named_file_cannot_stand_in_for_the_data(gen, tmp_path):
    root, files = gen
    data = b"the upper layer's file\n"
    d = _digest(data)
    assert _make(root, files, [Entry("etc/conf", "file", size=len(data), digest=d)],
                 {d: data}) == 1
    lower = tmp_path / "lower"
    (lower / "etc").mkdir(parents=True)
    (lower / d.removeprefix("sha256:")).write_bytes(b"forged by a lower layer\n")
    (lower / "etc" / "conf").write_bytes(b"the lower layer's own conf\n")
    merged = tmp_path / "merged"
    merged.mkdir()
    from runtime_shim.isolation.mount import OverlaySpec, mount_overlay

    mount_overlay(OverlaySpec(str(merged), (str(root / "mnt"), str(lower))))
    try:
        assert (merged / "etc" / "conf").read_bytes() == data
    finally:
        unmount(str(merged))


def test_a_symlinked_or_wrong_sized_cache_file_is_not_used(gen, tmp_path):
    root, files = gen
    a, b = b"aaaa\n", b"bbbb\n"
    da, db = _digest(a), _digest(b)
    target = tmp_path / "outside"
    target.write_bytes(a)
    os.symlink(target, files / da.removeprefix("sha256:"))
    (files / db.removeprefix("sha256:")).write_bytes(b"xy")  # not the TOC's 5 bytes
    entries = [Entry("a", "file", size=len(a), digest=da),
               Entry("b", "file", size=len(b), digest=db)]
    nodes = build_tree(entries)
    by = {"a": da, "b": db}
    dirs, fl = metalayer.plan(nodes, lambda n: by[n.read_path], {da, db})
    assert metalayer.build(str(root / "tree"), str(root / "data"), dirs, fl,
                           lambda h: [str(files / h)]) == 0
    assert os.listdir(root / "tree") == [] and os.listdir(root / "data") == []
    _mount(root)


def test_a_hundred_thousand_files_build_in_bounded_time(gen):
    root, files = gen
    contents = {_digest(f"{i}\n".encode()): f"{i}\n".encode() for i in range(100)}
    digests = list(contents)
    entries = [Entry(f"d{i // 100}/f{i}", "file", size=len(contents[digests[i % 100]]),
                     digest=digests[i % 100]) for i in range(100_000)]
    t0 = time.monotonic()
    placed = _make(root, files, entries, contents)
    took = time.monotonic() - t0
    assert placed == 100_000
    assert took < 60, took  # linear: ~4 s here under a load of 7 (tmpfs tree)
    assert (root / "mnt" / "d999" / "f99999").read_bytes() == b"99\n"
