#!/usr/bin/env python3
"""The asyncio SDK against the sync one, over real runc (busybox env).

    PYTHONPATH=. .venv/bin/python benchmarks/sdk_async.py [--sandboxes 20] [--execs 200]

1. exec round trip of ``true`` in one live sandbox: p50 / p95, ``Sandbox.exec`` (poll loop)
   vs ``await AsyncSandbox.exec`` (the same exchange on the event loop);
2. ``--sandboxes`` created concurrently from one loop (``asyncio.gather``), each streaming a
   3-line command, then closed: wall time, and the peak number of threads of the process
   (create/close run in the default executor; execs use none).

Builds ``env/busybox-shell`` into a temporary store first (the test suite's defs).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _stats import pct  # noqa: E402

from runtime_shim import AsyncSandbox, Sandbox  # noqa: E402
from tests.integration.conftest import build_busybox_env  # noqa: E402

ENV = "env/busybox-shell"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=20)
    ap.add_argument("--execs", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store, node = build_busybox_env(Path(tmp))
        with Sandbox.create(ENV, store=store, node_dir=node) as sb:
            sync = []
            for _ in range(args.execs):
                t = time.perf_counter()
                sb.exec(["true"])
                sync.append(time.perf_counter() - t)

            async def async_execs():
                asb = AsyncSandbox(sb)
                out = []
                for _ in range(args.execs):
                    t = time.perf_counter()
                    await asb.exec(["true"])
                    out.append(time.perf_counter() - t)
                return out

            asy = asyncio.run(async_execs())
        for name, xs in (("sync ", sync), ("async", asy)):
            print(f"exec true   {name} p50 {pct(xs, 50) * 1e3:.2f} ms  "
                  f"p95 {pct(xs, 95) * 1e3:.2f} ms")

        peak = 0

        async def fleet():
            nonlocal peak

            async def one(i):
                async with await AsyncSandbox.create(ENV, store=store, node_dir=node) as s:
                    lines = []
                    await s.exec(f"echo {i}; sleep 0.2; echo {i}; sleep 0.2; echo {i}",
                                 on_stdout=lines.append)
                    return len(lines)

            async def watch():
                nonlocal peak
                while True:
                    peak = max(peak, threading.active_count())
                    await asyncio.sleep(0.01)

            w = asyncio.ensure_future(watch())
            t = time.perf_counter()
            got = await asyncio.gather(*(one(i) for i in range(args.sandboxes)))
            w.cancel()
            return time.perf_counter() - t, got

        wall, got = asyncio.run(fleet())
        print(f"{args.sandboxes} async sandboxes create+stream+close: {wall:.2f} s wall, "
              f"peak threads {peak}, chunks {statistics.mean(got):.1f}/exec")


if __name__ == "__main__":
    main()
