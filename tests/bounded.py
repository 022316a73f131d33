"""``run_bounded``: a call that may block, run so that a test fails instead of hanging the suite
(the security tests of reads and writes that must never block on a FIFO or a device)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_bounded(fn: Callable[[], Any], seconds: float = 10) -> Any:
    """``fn()`` in a daemon thread: its value, or its exception re-raised; an assertion error
    if it has not returned within ``seconds``."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked"
    if "error" in box:
        raise box["error"]
    return box.get("value")
