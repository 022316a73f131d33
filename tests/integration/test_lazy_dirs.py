"""With ``$ENVBUILD_LAZY_READDIRPLUS=on`` a passthrough mount answers directory listings with
READDIRPLUS (``fusewire.MetaTree._readdir``): each entry carries its lookup reply, so the kernel
makes the children's dentries while the directory is listed and a later lookup of a listed
name costs no LOOKUP round trip to the daemon (the cold_start workload: 2,093 LOOKUPs ->
1,411; off by default: no faster there, see ``READDIRPLUS_ENV``). What the entries say is
what a lookup would have said: sizes, modes, one inode for a hardlink's names; a directory of
more than ``READDIRPLUS_MAX_ENTRIES`` makes no dentries. ``off`` (the default) keeps plain
READDIR (and every lookup). Real passthrough mounts served by the node daemon from a store
directory."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from envbuild.store import LocalStore
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.lazyfs import lazy_stats
from runtime_shim.lazyfs.fusewire import READDIRPLUS_MAX_ENTRIES
from runtime_shim.node.nodecache import NodeCache
from tests.conftest import require_root, require_tool
from tests.integration.test_lazy_xattrs import _layer

pytestmark = pytest.mark.integration

LOOKUP, OPENDIR, READDIR, RELEASEDIR, READDIRPLUS = "1", "27", "28", "29", "44"
NAMES = [f"m{i:02d}.py" for i in range(40)]


def _tree(root: Path) -> None:
    for d in ("listed", "unlisted"):
        (root / d).mkdir(parents=True)
        for i, name in enumerate(NAMES):
            (root / d / name).write_bytes(b"x" * i)
    (root / "listed" / "sub").mkdir()
    os.link(root / "listed" / "m05.py", root / "listed" / "again.py")
    (root / "huge").mkdir()
    for i in range(READDIRPLUS_MAX_ENTRIES + 1):
        (root / "huge" / f"e{i}").touch()


def _ops(mp: Path) -> dict[str, int]:
    return lazy_stats(mp)["requests_by_opcode"]


@contextlib.contextmanager
def _mounted(tmp_path: Path, monkeypatch, tree: Callable[[Path], None] | None = None,
             **env: str) -> Iterator[Path]:
    """``tree`` (default ``_tree``) packed into a store and mounted lazily by the node daemon
    (passthrough, with ``env`` set for it); unmounted after, leaving no mount."""
    require_root()
    require_tool("fusermount3")
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "on")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    src = tmp_path / "src"
    (tree or _tree)(src)
    store = LocalStore(tmp_path / "store")
    digest, toc = _layer(src, store, tmp_path)
    node = NodeCache(tmp_path / "node")
    try:
        yield node.ensure_lazy(str(store.root), digest, toc)
    finally:
        node.unmount_lazy(keep=())
    assert mounted_targets_under(str(tmp_path / "node")) == []


@pytest.mark.parametrize("plus", ["on", "off"])
def test_a_listed_directory_needs_no_lookup_of_its_names(tmp_path, monkeypatch, plus):
    with _mounted(tmp_path, monkeypatch, ENVBUILD_LAZY_READDIRPLUS=plus) as mp:
        (mp / "listed").stat(), (mp / "unlisted").stat()
        assert sorted(os.listdir(mp / "listed")) == sorted([*NAMES, "again.py", "sub"])
        before = _ops(mp)
        got = {name: os.lstat(mp / "listed" / name) for name in NAMES}
        after_listed = _ops(mp)
        for name in NAMES:
            os.lstat(mp / "unlisted" / name)
        after_unlisted = _ops(mp)

        def lookups(a: dict[str, int], b: dict[str, int]) -> int:
            return b.get(LOOKUP, 0) - a.get(LOOKUP, 0)

        # the names of a directory never listed: one LOOKUP each, either way
        assert lookups(after_listed, after_unlisted) >= len(NAMES), after_unlisted
        if plus == "on":
            assert after_listed.get(READDIRPLUS, 0) >= 1 and READDIR not in after_listed
            assert lookups(before, after_listed) == 0, (before, after_listed)
        else:
            assert after_listed.get(READDIR, 0) >= 1 and READDIRPLUS not in after_listed
            assert lookups(before, after_listed) >= len(NAMES), after_listed
        # what the listing told the kernel is what the layer holds
        for i, name in enumerate(NAMES):
            st = got[name]
            assert stat.S_ISREG(st.st_mode) and st.st_size == i, (name, st)
            assert (mp / "listed" / name).read_bytes() == b"x" * i
        again = os.lstat(mp / "listed" / "again.py")
        assert again.st_ino == got["m05.py"].st_ino and again.st_nlink == 2
        assert stat.S_ISDIR(os.lstat(mp / "listed" / "sub").st_mode)
        # a directory beyond the bound is listed whole, but makes no dentries: its names are
        # looked up as before (the kernel keeps no inode per entry of a huge listing)
        huge = sorted(os.listdir(mp / "huge"))
        assert huge == sorted(f"e{i}" for i in range(READDIRPLUS_MAX_ENTRIES + 1))
        a = _ops(mp)
        for name in huge[:20]:
            os.lstat(mp / "huge" / name)
        assert lookups(a, _ops(mp)) >= 20


@pytest.mark.parametrize("no_opendir", ["1", "0"])
def test_directories_open_without_a_round_trip(tmp_path, monkeypatch, no_opendir):
    """A passthrough mount answers its first OPENDIR "not implemented" (``NO_OPENDIR``): the
    kernel then opens its directories without asking and sends no RELEASEDIR (the cold_start
    workload: 2 x 253 requests fewer), while listings stay whole and cached (the second
    listing of a directory sends no READDIR). ``$ENVBUILD_LAZY_NO_OPENDIR=0``: a round trip
    per open and per close."""
    with _mounted(tmp_path, monkeypatch, ENVBUILD_LAZY_NO_OPENDIR=no_opendir) as mp:
        want = sorted([*NAMES, "again.py", "sub"])
        for _ in range(3):
            assert sorted(os.listdir(mp / "listed")) == want
            assert sorted(os.listdir(mp / "unlisted")) == sorted(NAMES)
        ops = _ops(mp)
        if no_opendir == "1":
            assert ops.get(OPENDIR, 0) <= 1 and RELEASEDIR not in ops, ops
        else:
            assert ops.get(OPENDIR, 0) >= 6 and ops.get(RELEASEDIR, 0) >= 6, ops
        assert ops.get(READDIR, 0) <= 4, ops   # each directory listed once, then cached
        with os.scandir(mp / "listed") as it:   # a handle still reads
            assert sorted(e.name for e in it) == want
