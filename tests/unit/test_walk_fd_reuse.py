"""The walker names each file through the directory fd its cursor holds *when the file is
yielded*: after coming back up from a subdirectory the cursor's fd is a new one, and the one the
listing saw may be closed or reused by another thread (a parallel build). Found packing a pip
venv with ``build --jobs 2`` (``open …/auth.py: Bad file descriptor``)."""

from __future__ import annotations

import io
import os

from envbuild.layers import LayerReader, pack_tree
from envbuild.safefs import DirCursor


def test_files_after_a_subdirectory_are_read_through_the_current_fd(tmp_path, monkeypatch):
    root = tmp_path / "t"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "inner.txt").write_text("inner")
    (root / "a" / "c.txt").write_text("after the subdirectory")  # "b" < "c.txt"
    (root / "z.txt").write_text("last")
    held: list[int] = []
    real_up = DirCursor.up

    def up_while_another_thread_takes_fds(self):
        # what another thread does between the cursor's down() and up(): it takes the lowest
        # free fd numbers, so up() cannot land on the number the listing saw
        held.extend(os.open(os.devnull, os.O_RDONLY) for _ in range(3))
        real_up(self)

    monkeypatch.setattr(DirCursor, "up", up_while_another_thread_takes_fds)
    out = io.BytesIO()
    try:
        pack_tree(root, out)
    finally:
        for fd in held:
            os.close(fd)
    blob = out.getvalue()
    reader = LayerReader(lambda off, n: blob[off:off + n], len(blob))
    assert reader.read("a/c.txt") == b"after the subdirectory"
    assert reader.read("a/b/inner.txt") == b"inner"
    assert reader.read("z.txt") == b"last"
