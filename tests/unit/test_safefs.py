"""envbuild.safefs: no-follow opens and the iterative, fd-based tree removal."""

from __future__ import annotations

import errno
import os

import pytest

from envbuild import safefs


def _deep(root, depth):
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):  # relative mkdirs: a 4096-deep path is far over PATH_MAX
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
        f.write("x")
    os.close(fd)


def test_remove_tree_deeper_than_recursion_and_path_max(tmp_path):
    (tmp_path / "t").mkdir()
    _deep(tmp_path / "t", 5000)
    safefs.remove_tree(tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_remove_tree_never_follows_symlinks(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("precious")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "link").symlink_to(outside)
    (tree / "sub" / "up").symlink_to("../../outside")
    safefs.remove_tree(tree)
    assert not tree.exists()
    assert (outside / "keep").read_text() == "precious"
    link = tmp_path / "toplink"
    link.symlink_to(outside)
    safefs.remove_tree(link)  # the link goes, not its target
    assert not link.is_symlink() and (outside / "keep").exists()


def test_remove_tree_missing_and_file(tmp_path):
    safefs.remove_tree(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        safefs.remove_tree(tmp_path / "nope", missing_ok=False)
    (tmp_path / "f").write_text("x")
    safefs.remove_tree(tmp_path / "f")
    assert not (tmp_path / "f").exists()


def test_open_in_root_and_beneath_refuse_escapes(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (tmp_path / "secret").write_text("host")
    (root / "etc" / "passwd").symlink_to("/../../secret")
    (root / "dirlink").symlink_to(tmp_path)
    rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(FileNotFoundError):  # resolved inside the root, where it is missing
            safefs.open_in_root(rfd, "etc/passwd", os.O_RDONLY)
        with pytest.raises(OSError) as e:
            safefs.open_beneath(rfd, "dirlink/secret", os.O_RDONLY)
        assert e.value.errno == errno.ELOOP
        with pytest.raises(OSError) as e:
            safefs.open_beneath(rfd, "../secret", os.O_RDONLY)
        assert e.value.errno == errno.EXDEV
        fd = safefs.open_beneath(rfd, "etc", os.O_RDONLY | os.O_DIRECTORY)
        os.close(fd)
    finally:
        os.close(rfd)


def test_read_tail_reads_only_the_end_of_a_regular_file(tmp_path):
    log = tmp_path / "log"
    log.write_bytes(b"x" * 100_000 + b"\nlast line \xff\n")
    tail = safefs.read_tail(log, 1000)
    assert len(tail) == 1000 and tail.endswith("last line \ufffd\n")
    assert safefs.read_tail(log, 1 << 20) == log.read_bytes().decode(errors="replace")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as e:   # at once: it never waits for a writer
        safefs.read_tail(fifo, 1000)
    assert e.value.errno == errno.EINVAL
    link = tmp_path / "link"
    link.symlink_to(log)
    with pytest.raises(OSError) as e:
        safefs.read_tail(link, 1000)
    assert e.value.errno == errno.ELOOP
