"""Hostile archives against ``strip_components`` (issue 17 item 4), through the real importer
(``import_archive``, the one safe unpacker): a strip must never turn a refused or harmless
member into one that escapes ``dest``, writes through a symlink, or silently loses files."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from envbuild.build.importers import import_archive
from envbuild.errors import UnsafeLayerError

pytestmark = pytest.mark.integration


def _archive(path: Path, members) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, kind, extra in members:
            ti = tarfile.TarInfo(name)
            if kind == "file":
                ti.size, ti.mode = len(extra), 0o644
                tf.addfile(ti, io.BytesIO(extra))
            else:
                ti.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                           "hardlink": tarfile.LNKTYPE}[kind]
                ti.mode, ti.linkname = 0o755, extra or ""
                tf.addfile(ti)
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def _import(tmp_path: Path, members, strip: int) -> Path:
    tgz = tmp_path / "a.tgz"
    sha = _archive(tgz, members)
    dest = tmp_path / "dest"
    dest.mkdir()
    import_archive(tgz, "sha256:" + sha, dest, strip_components=strip)
    return dest


def test_a_symlink_the_strip_moves_to_the_top_is_never_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    members = [("top", "dir", None), ("top/lib", "symlink", str(outside)),
               ("top/lib/pwned", "file", b"x")]
    with pytest.raises(UnsafeLayerError):
        _import(tmp_path, members, 1)
    assert list(outside.iterdir()) == []


def test_dotdot_inside_the_stripped_prefix_is_refused(tmp_path):
    with pytest.raises(UnsafeLayerError, match="'..'"):
        _import(tmp_path, [("x/../../escape", "file", b"x")], 1)
    assert not (tmp_path / "escape").exists() and not (tmp_path.parent / "escape").exists()


def test_a_hardlink_to_a_file_the_strip_removed_is_refused(tmp_path):
    # /etc/shadow-like target that only exists above the stripped top: never linked to
    members = [("top", "dir", None), ("top/f", "file", b"f"), ("top/h", "hardlink", "top")]
    with pytest.raises(UnsafeLayerError, match="removes"):
        _import(tmp_path, members, 1)


@pytest.mark.parametrize("strip", [-1, 17, 2**63])
def test_out_of_range_strips_are_refused_before_anything_is_written(tmp_path, strip):
    with pytest.raises(UnsafeLayerError, match="not within"):
        _import(tmp_path, [("top/f", "file", b"f")], strip)
    assert os.listdir(tmp_path / "dest") == []


def test_a_strip_deeper_than_the_archive_is_refused_not_an_empty_workspace(tmp_path):
    with pytest.raises(UnsafeLayerError, match="leaves nothing"):
        _import(tmp_path, [("top", "dir", None), ("top/sub", "dir", None)], 3)
