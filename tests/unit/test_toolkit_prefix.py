"""``check_toolkit_prefix``: what a toolkit may leave outside its prefix, on deep trees too."""

from __future__ import annotations

import os

import pytest

from envbuild.build.executor import check_toolkit_prefix
from envbuild.errors import BuildError


def test_files_and_empty_dirs_outside_the_prefix_are_reported(tmp_path):
    (tmp_path / "opt" / "toolkits" / "t" / "bin").mkdir(parents=True)
    (tmp_path / "opt" / "toolkits" / "t" / "bin" / "tool").write_text("x")
    check_toolkit_prefix("t", tmp_path, "/opt/toolkits/t")
    (tmp_path / "root").mkdir()
    (tmp_path / "var" / "cache").mkdir(parents=True)
    (tmp_path / "var" / "cache" / "junk").write_text("x")
    os.symlink("/etc", tmp_path / "etc-link")
    with pytest.raises(BuildError) as ei:
        check_toolkit_prefix("t", tmp_path, "/opt/toolkits/t")
    assert "/etc-link, /root, /var/cache/junk" in ei.value.message


def test_a_1500_deep_tree_is_checked_without_recursion(tmp_path):
    d = os.open(tmp_path, os.O_RDONLY)
    for _ in range(1500):  # os.walk raised RecursionError here
        os.mkdir("a", dir_fd=d)
        nd = os.open("a", os.O_RDONLY, dir_fd=d)
        os.close(d)
        d = nd
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=d))
    os.close(d)
    try:
        with pytest.raises(BuildError, match="wrote outside its prefix"):
            check_toolkit_prefix("t", tmp_path, "/opt/toolkits/t")
    finally:
        from envbuild.safefs import remove_tree

        remove_tree(tmp_path / "a")  # pytest's own cleanup recurses
