"""Byte progress of long transfers (``envbuild push``, ``pull``, ``export``).

The library counts, the CLI renders: a ``TransferMeter`` is handed to ``sync`` /
``export_lock``, which announce the bytes they are going to move (``expect``) and count each
byte read from the source store as it passes (``track`` on the source stream); ``on_change``
is called after each change with ``(done, total)``. The rendering (a throttled line on a
terminal, a summary line always) is ``envbuild.cli.progress``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import BinaryIO

from envbuild.store._types import VerifyingReader


class TransferMeter:
    """Bytes done and bytes expected of one transfer; safe to update from several threads."""

    def __init__(self, on_change: Callable[[int, int], None] | None = None) -> None:
        self.done = 0
        self.total = 0
        self._on_change = on_change
        self._lock = threading.Lock()

    def expect(self, n: int) -> None:
        """``n`` more bytes will be moved."""
        self._change(0, n)

    def add(self, n: int) -> None:
        """``n`` bytes were moved."""
        self._change(n, 0)

    def _change(self, done: int, total: int) -> None:
        with self._lock:
            self.done += done
            self.total += total
            now = (self.done, self.total)
        if self._on_change is not None:
            self._on_change(*now)

    def track(self, stream: BinaryIO) -> BinaryIO:
        """Count what is read from ``stream``, a store's ``get`` (a ``VerifyingReader``, by the
        ``Store`` contract; it stays the object the writer sees, so a store that trusts its
        verification still does). Any other stream is returned uncounted."""
        if isinstance(stream, VerifyingReader):
            stream.watch(self.add)
        return stream


def track(meter: TransferMeter | None, stream: BinaryIO) -> BinaryIO:
    """``meter.track(stream)``, or ``stream`` when there is no meter."""
    return stream if meter is None else meter.track(stream)
