"""Helpers shared by the layer tests (unit and integration): tree snapshots, in-memory layers."""

from __future__ import annotations

import hashlib
import io
import os
import stat

from envbuild.layers import Framing, LayerReader, pack_tree

# tiny frames so small test files still cross frame boundaries
TINY = Framing(name="lazy", small_file=1024, shared_frame=4096, max_frame=16384)
TINY_COMPACT = Framing(name="compact", max_frame=16384)


def snapshot(root: str | os.PathLike, *, mtimes: bool = True,
             xattr_prefixes: tuple[str, ...] = ("user.", "security.")) -> dict:
    """Everything a layer must preserve about a tree, keyed by relative path.

    Hardlinks are reported as the sorted group of paths sharing an inode, so two trees compare
    equal when they link the same names together."""
    root = os.fspath(root)
    out: dict[str, tuple] = {}
    inodes: dict[tuple[int, int], list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in sorted(dirnames + filenames):
            full = os.path.join(dirpath, n)
            rel = os.path.relpath(full, root)
            st = os.lstat(full)
            fmt = stat.S_IFMT(st.st_mode)
            if stat.S_ISREG(fmt):
                with open(full, "rb") as f:
                    what = hashlib.sha256(f.read()).hexdigest()
                if st.st_nlink > 1:
                    inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)
            elif stat.S_ISLNK(fmt):
                what = os.readlink(full)
            elif stat.S_ISCHR(fmt) or stat.S_ISBLK(fmt):
                what = (os.major(st.st_rdev), os.minor(st.st_rdev))
            else:
                what = None
            try:
                names = os.listxattr(full, follow_symlinks=False)
            except OSError:
                names = []
            xattrs = {k: os.getxattr(full, k, follow_symlinks=False) for k in sorted(names)
                      if k.startswith(xattr_prefixes)}
            out[rel] = (fmt, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, what, xattrs,
                        int(st.st_mtime) if mtimes and not stat.S_ISLNK(fmt) else None)
    for group in inodes.values():
        for rel in group:
            out[rel] = out[rel] + (tuple(sorted(group)),)
    return out


def pack_bytes(src, **kwargs):
    buf = io.BytesIO()
    info = pack_tree(src, buf, **kwargs)
    data = buf.getvalue()
    assert len(data) == info.size
    assert "sha256:" + hashlib.sha256(data).hexdigest() == info.digest
    return data, info


class RecordingSource:
    """A ``get_range`` over bytes that records every range asked for."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.calls: list[tuple[int, int]] = []

    def __call__(self, offset: int, length: int) -> bytes:
        self.calls.append((offset, length))
        return self.data[offset:offset + length]


def reader_of(data: bytes, name: str = "test-layer", **kwargs) -> LayerReader:
    return LayerReader(RecordingSource(data), len(data), name=name, **kwargs)


def test_snapshot_sees_modes_links_and_xattrs(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    os.chmod(tmp_path / "f", 0o4755)
    os.link(tmp_path / "f", tmp_path / "g")
    os.symlink("f", tmp_path / "s")
    os.setxattr(tmp_path / "f", "user.k", b"v")
    snap = snapshot(tmp_path)
    assert snap["f"][1] == 0o4755 and snap["f"][5] == {"user.k": b"v"}
    assert snap["f"][-1] == ("f", "g") and snap["s"][4] == "f"
