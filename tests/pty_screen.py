"""``Screen``: what a terminal printed, fed from the thread that reads it, waited on by a test
(the SDK's PTYs in tests/integration/test_sdk_pty.py, the e2b SDK's in test_e2b_pty.py)."""

from __future__ import annotations

import re
import threading
import time


class Screen:
    """What a terminal printed, fed from the reader's thread, waited on from the test's."""

    def __init__(self) -> None:
        self.data = b""
        self.cond = threading.Condition()

    def feed(self, chunk: bytes) -> None:
        with self.cond:
            self.data += chunk
            self.cond.notify_all()

    def wait_for(self, pattern: bytes, timeout: float = 15) -> re.Match[bytes]:
        """The first match of the regex ``pattern`` in what came after the last match (which
        is then dropped); an assertion error showing the screen's tail after ``timeout``."""
        with self.cond:
            deadline = time.monotonic() + timeout
            while not (m := re.search(pattern, self.data)):
                left = deadline - time.monotonic()
                assert left > 0, f"no {pattern!r} in {self.data[-400:]!r}"
                self.cond.wait(left)
            self.data = self.data[m.end():]
            return m
