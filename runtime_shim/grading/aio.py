"""``grade_async``: ``grade`` for asyncio callers (a trainer's event loop grading many
submissions at once). Grading blocks on disk, the store and a sandbox's command, so it runs in
a worker thread; the loop stays free."""

from __future__ import annotations

import asyncio
from typing import Any

from runtime_shim.grading.grader import grade
from runtime_shim.grading.verdict import Verdict


async def grade_async(task: str, source: str, **kwargs: Any) -> Verdict:
    """``await grade_async(task, source, ...)``: the same arguments and result as ``grade``."""
    return await asyncio.to_thread(grade, task, source, **kwargs)
