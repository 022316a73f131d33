"""Build logs on the host, bounded: per build, and per log directory.

A build's output is untrusted (a definition's ``run`` steps, a Dockerfile, an importer) and
its log lives on the host, outside every capped disk. So:

* **Per build**, a log holds at most ``cap`` bytes (``BUILD_LOG_CAP``, for run steps and
  Dockerfile builds alike): once it grows past that it is trimmed in place to its first
  ``cap // 4`` bytes, a ``TRIM_NOTE`` line, and its last ``cap // 4`` bytes, so the start
  (what ran) and the end (why it failed) are both kept, whatever was printed in between.
  ``CappedLog`` trims as it is written; ``trim`` trims a log another writer (a subprocess
  given the file) appended to.
* **Per directory** (``<store>/logs``), ``prune`` deletes the oldest logs once the directory
  holds more than ``LOG_DIR_CAP`` bytes, sparing logs written in the last ``PRUNE_MIN_AGE``
  (builds still running); ``envbuild gc`` collects the logs of builds no key record
  references once they are older than the grace period (``envbuild.store.gc``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

#: What one build's log may hold (on the host, outside its capped disk): past it the log keeps
#: its first and last quarter, so a step that prints forever (``yes``) costs the host this
#: much, and the end of its output (why it failed) is kept. Read at each use (tests lower it).
BUILD_LOG_CAP = 16 << 20
#: What a log directory may hold before ``prune`` deletes its oldest logs.
LOG_DIR_CAP = 1 << 30
#: ``prune`` never deletes a log written to more recently than this (seconds).
PRUNE_MIN_AGE = 3600.0
TRIM_NOTE = b"\n[envbuild: output trimmed here; the log keeps its first and last part]\n"


def trim(path: Path, cap: int) -> None:
    """Trim the log ``path`` to its head, ``TRIM_NOTE`` and its tail if it is over ``cap``."""
    try:
        with open(path, "r+b") as f:
            _trim(f, cap)
    except FileNotFoundError:
        pass


def _trim(f, cap: int) -> None:
    size = f.seek(0, os.SEEK_END)
    if size <= cap:
        return
    part = max(1, cap // 4)
    f.seek(size - part)
    tail = f.read(part)
    f.seek(part)
    f.write(TRIM_NOTE)
    f.write(tail)
    f.truncate()
    f.seek(0, os.SEEK_END)


class CappedLog:
    """A build log opened for appending, trimmed (``trim``) each time it grows past ``cap``:
    at most ``cap`` bytes on disk, and O(1) work per byte written (a trim halves the file)."""

    def __init__(self, path: Path, cap: int) -> None:
        self.path, self.cap = path, cap
        self._f = open(path, "ab+")  # noqa: SIM115 (closed by close())
        self._size = self._f.seek(0, os.SEEK_END)

    def write(self, data: bytes) -> int:
        self._f.write(data)
        self._size += len(data)
        if self._size > self.cap:
            self._f.flush()
            with open(self.path, "r+b") as f:
                _trim(f, self.cap)
                self._size = f.tell()
        return len(data)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> CappedLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def prune(log_dir: Path, cap: int = LOG_DIR_CAP, *, min_age: float = PRUNE_MIN_AGE) -> None:
    """Delete the oldest ``*.log`` files of ``log_dir`` while it holds more than ``cap`` bytes,
    never one modified in the last ``min_age`` seconds."""
    try:
        entries = [e for e in os.scandir(log_dir) if e.name.endswith(".log")
                   and e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return
    stats = sorted(((e.stat(follow_symlinks=False), e.path) for e in entries),
                   key=lambda s: s[0].st_mtime)
    total = sum(st.st_size for st, _ in stats)
    young = time.time() - min_age
    for st, path in stats:
        if total <= cap or st.st_mtime > young:
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        total -= st.st_size


class Tee:
    """The log file, with each write also handed to ``on_output`` (for ``build -v``): the
    first ``BUILD_LOG_CAP`` bytes of the step's output, then a note (the log keeps the end)."""

    def __init__(self, out, name: str, on_output: Callable[[str, bytes], None]) -> None:
        self.out, self.name, self.on_output = out, name, on_output
        self.left = BUILD_LOG_CAP

    def write(self, data: bytes) -> int:
        n = self.out.write(data)
        if self.left > 0:
            shown = bytes(data[:self.left])
            self.left -= len(data)
            if self.left <= 0:
                shown += f"\n[envbuild: output past {BUILD_LOG_CAP >> 10} KiB not shown; the " \
                         "log keeps its end]\n".encode()
            self.on_output(self.name, shown)
        return n

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        self.out.close()
