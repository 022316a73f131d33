"""``envbuild.atomic``: the one atomic write (issue 38, item 2)."""

from __future__ import annotations

import os
import stat

import pytest

from envbuild.atomic import atomic_file, write_atomic


def test_writes_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "f.json"
    write_atomic(path, "one")
    write_atomic(path, b"two", fsync=True, fsync_dir=True)
    assert path.read_text() == "two" and os.listdir(tmp_path) == ["f.json"]


def test_a_failure_keeps_the_old_content_and_removes_the_temp(tmp_path):
    path = tmp_path / "f"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_file(path) as f:
        f.write(b"half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f"]


def test_mode_is_masked_by_the_umask_and_prefix_names_the_temp(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a", b"", mode=0o600)
        write_atomic(tmp_path / "b", b"")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o644
    seen = []
    with atomic_file(tmp_path / "c", tmp_prefix=".tmp-"):
        seen = sorted(os.listdir(tmp_path))
    assert [n for n in seen if n.startswith(".tmp-")] and "c" not in seen


def test_a_symlink_at_the_destination_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "link").symlink_to(victim)
    write_atomic(tmp_path / "link", "new")
    assert victim.read_text() == "keep"
    assert not (tmp_path / "link").is_symlink() and (tmp_path / "link").read_text() == "new"


def test_a_missing_directory_is_an_oserror_and_nothing_is_left(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "no" / "f", b"x")
    assert os.listdir(tmp_path) == []
