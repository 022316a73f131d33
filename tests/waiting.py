"""Waiting in tests for a condition another thread or process brings about: poll it until
it holds or a deadline passes (a failed assertion naming what did not come)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(check: Callable[[], object], timeout: float = 10.0, what: str = "the condition",
             interval: float = 0.02) -> None:
    """Return once ``check()`` is true; ``AssertionError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)
