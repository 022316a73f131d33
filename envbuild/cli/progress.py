"""Progress of long transfers on stderr: ``envbuild push``, ``pull`` and ``export``.

The library counts the bytes (``envbuild.store.progress.TransferMeter``); this renders them.
``--progress auto`` (the default) draws a line on stderr while bytes move, redrawn in place at
most every ``TTY_INTERVAL`` seconds, when stderr is a terminal; ``always`` draws it also into a
pipe or log (one line per ``PLAIN_INTERVAL`` seconds, no carriage returns); ``never`` draws
nothing. Whatever the mode, the transfer ends with one summary line on stderr (``push: 42.0 MB
in 6.1 s (6.9 MB/s)``); stdout stays for the command's output, its ``--json`` included. (The
build's per-layer progress is ``cmd_build``'s ``PlainProgress``/``RichProgress``.)
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import click

from envbuild.errors import SettingsError
from envbuild.sizes import human_size
from envbuild.store.progress import TransferMeter

MODES = ("auto", "always", "never")
#: ``--progress``, shared by push, pull and export.
progress_option = click.option(
    "--progress", "progress_mode", metavar="auto|always|never", default="auto",
    show_default=True, help="Byte progress on stderr: auto draws it on a terminal; a summary "
                            "line is written to stderr in every mode.")
TTY_INTERVAL = 0.2
PLAIN_INTERVAL = 1.0


def format_rate(done: int, seconds: float) -> str:
    return f"{human_size(done / seconds)}/s" if seconds > 0 else "-"


def progress_line(verb: str, done: int, total: int, seconds: float) -> str:
    """``push: 4.2 MB / 12.3 MB (34%), 10.1 MB/s``."""
    pct = f" ({min(100, done * 100 // total)}%)" if total else ""
    return (f"{verb}: {human_size(done)} / {human_size(total)}{pct}, "
            f"{format_rate(done, seconds)}")


def summary_line(verb: str, done: int, seconds: float) -> str:
    """``push: 12.3 MB in 1.2 s (10.3 MB/s)``."""
    return f"{verb}: {human_size(done)} in {seconds:.1f} s ({format_rate(done, seconds)})"


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise SettingsError(f"unknown progress mode {mode!r}", hint="use auto, always or never")
    return mode


class TransferProgress:
    """Draws ``meter``'s progress (``live``: on a terminal, redrawn in place with ``tty``) and
    writes the summary at ``finish``. ``write`` and ``clock`` are seams for tests."""

    def __init__(self, verb: str, *, live: bool, tty: bool,
                 write: Callable[[str], object] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.verb, self.live, self.tty = verb, live, tty
        self._write = write or _stderr
        self._clock = clock
        self._start = clock()
        self._last = float("-inf")
        self._drawn = False
        self._lock = threading.Lock()
        self.meter = TransferMeter(self._changed)

    @classmethod
    def for_stderr(cls, verb: str, mode: str) -> TransferProgress:
        """The renderer for ``--progress MODE`` on this process's stderr."""
        tty = sys.stderr.isatty()
        return cls(verb, live=check_mode(mode) == "always" or (mode == "auto" and tty),
                   tty=tty)

    def _changed(self, done: int, total: int) -> None:
        if not self.live:
            return
        with self._lock:
            now = self._clock()
            interval = TTY_INTERVAL if self.tty else PLAIN_INTERVAL
            if now - self._last < interval and done < total:
                return  # throttled; the last byte is always drawn
            self._last = now
            line = progress_line(self.verb, done, total, now - self._start)
            self._write(f"\r{line}\x1b[K" if self.tty else line + "\n")
            self._drawn = True

    def finish(self) -> None:
        """The summary line (after clearing a line drawn in place)."""
        with self._lock:
            if self._drawn and self.tty:
                self._write("\r\x1b[K")
            self._write(summary_line(self.verb, self.meter.done,
                                     self._clock() - self._start) + "\n")


def _stderr(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()
