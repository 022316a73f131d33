#!/usr/bin/env python3
"""What a sandbox's own network costs: create → exec ``true`` → close, p50 / p90, for
``network=False``, ``network=True`` and an allow-list (``runtime_shim.isolation.netns``: a namespace,
its firewall and slirp4netns per sandbox).

    .venv/bin/python benchmarks/sandbox_network.py [--store DIR] [--env busybox-shell] [--runs 30]

Needs root, runc, slirp4netns, iptables and the env built in the store (built if missing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _envs import ensure_built  # noqa: E402

from envbuild.store import LocalStore  # noqa: E402
from runtime_shim.sdk.sandbox import Sandbox  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=str(REPO / "cache"))
    ap.add_argument("--env", default="busybox-shell")
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    ensure_built(Path(args.store), args.env)
    store = LocalStore(args.store)
    with tempfile.TemporaryDirectory(prefix="eb-netbench-") as node:
        Sandbox.create(args.env, store=store, node_dir=node).close()  # warm the node cache
        for network in (False, True, ["198.18.0.0/15:443"]):
            times = []
            for _ in range(args.runs):
                t = time.monotonic()
                with Sandbox.create(args.env, store=store, node_dir=node,
                                    network=network) as sb:
                    sb.exec(["true"])
                times.append(time.monotonic() - t)
            times.sort()
            print(f"network={network!r:24} create+exec+close p50 "
                  f"{statistics.median(times) * 1000:6.1f} ms  p90 "
                  f"{times[int(len(times) * 0.9) - 1] * 1000:6.1f} ms")


if __name__ == "__main__":
    main()
