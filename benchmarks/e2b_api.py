#!/usr/bin/env python3
"""The E2B-compatible server (``envbuild serve``) driven by the real ``e2b`` SDK, against
``runtime_shim`` measured in the same run (issue 37, Performance).

    python benchmarks/e2b_api.py [--store DIR] [--env ENV] [--runs 20] [--execs 200]
                                 [--concurrent 100] [--mib 10] [--only PART,...]

Starts ``envbuild serve`` on 127.0.0.1 (a free port, a node dir of its own, ``--on-exit
kill``; each sandbox 64 MiB of memory, 256 MiB of disk, 16 pids x 256 files, so that
``--concurrent`` of them pass admission) and measures, baseline and candidate interleaved:

1. create → ``commands.run("true")`` → kill through the SDK, p50 over ``--runs``; baseline
   ``runtime_shim.Sandbox.create`` → ``exec(["true"])`` → ``close`` with the same limits.
   Goal: ratio <= 1.5.
2. ``commands.run("true")`` round trip p50 over ``--execs`` in one sandbox (baseline:
   ``Sandbox.exec(["true"])``). Goal: <= 3 ms.
3. ``--concurrent`` sandboxes created at once by the async SDK: errors (goal 0) and seconds.
4. ``files.write`` + ``files.read`` of ``--mib`` MiB: throughput against
   ``Sandbox.write_file`` + ``read_file``. Goal: ratio >= 0.5.

``--only files`` (or ``lifecycle``, ``roundtrip``, ``concurrent``, comma-separated) runs those
parts only. Prints one line per figure and the load average; exits 1 if the server leaves a sandbox.
Needs root, runc and ``ENV`` built in the store (``$ENVBUILD_STORE`` unless ``--store``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runtime_shim import Limits, Sandbox, list_sandboxes  # noqa: E402

PARTS = ("lifecycle", "roundtrip", "concurrent", "files")
LIMITS = Limits(memory_bytes=64 << 20, disk_bytes=256 << 20, pids=16, nofile=256)
SERVE_LIMITS = ("--memory", "64MiB", "--disk", "256MiB", "--pids", "16", "--nofile", "256")


def start_server(root: Path, store: str, node: Path) -> tuple[subprocess.Popen, str, str]:
    key = secrets.token_hex(16)
    (root / "keys").write_text(key + "\n")
    log = open(root / "serve.log", "w+b")  # noqa: SIM115 - the server's for its life
    env = {**os.environ, "ENVBUILD_STORE": store, "ENVBUILD_NODE_CACHE": str(node),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "envbuild.cli", "serve", "--listen",
                             "127.0.0.1:0", "--api-keys", str(root / "keys"), "--on-exit",
                             "kill", *SERVE_LIMITS], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = re.search(r"envbuild serve: (http://\S+)", (root / "serve.log").read_text())
        if m:
            return proc, m.group(1), key
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise SystemExit(f"envbuild serve did not start: {(root / 'serve.log').read_text()[-2000:]}")


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def lifecycle(env: str, store: str, node: Path, runs: int) -> tuple[list[float], list[float]]:
    from e2b import Sandbox as E2bSandbox

    e2b, base = [], []
    for _ in range(runs):
        t = time.perf_counter()
        sb = E2bSandbox.create(env)
        sb.commands.run("true")
        sb.kill()
        e2b.append(time.perf_counter() - t)
        t = time.perf_counter()
        with Sandbox.create(env, store=store, node_dir=node / "base", limits=LIMITS) as b:
            b.exec(["true"])
        base.append(time.perf_counter() - t)
    return e2b, base


def round_trips(env: str, store: str, node: Path, n: int) -> tuple[list[float], list[float]]:
    from e2b import Sandbox as E2bSandbox

    sb = E2bSandbox.create(env)
    e2b, base = [], []
    try:
        with Sandbox.create(env, store=store, node_dir=node / "base", limits=LIMITS) as b:
            for _ in range(n):
                t = time.perf_counter()
                sb.commands.run("true")
                e2b.append(time.perf_counter() - t)
                t = time.perf_counter()
                b.exec(["true"])
                base.append(time.perf_counter() - t)
    finally:
        sb.kill()
    return e2b, base


def concurrent_creates(env: str, n: int) -> tuple[int, float, str]:
    from e2b import AsyncSandbox

    async def main() -> tuple[int, float, str]:
        t = time.perf_counter()
        made = await asyncio.gather(*(AsyncSandbox.create(env, timeout=300) for _ in range(n)),
                                    return_exceptions=True)
        seconds = time.perf_counter() - t
        errors = [m for m in made if isinstance(m, BaseException)]
        await asyncio.gather(*(m.kill() for m in made if not isinstance(m, BaseException)))
        return len(errors), seconds, repr(errors[0])[:300] if errors else ""

    return asyncio.run(main())


def files(env: str, store: str, node: Path, mib: int) -> tuple[float, float]:
    """MiB/s of write + read through the SDK and through runtime_shim (best of 3 each)."""
    from e2b import Sandbox as E2bSandbox

    data = os.urandom(mib << 20)
    sb = E2bSandbox.create(env)
    e2b, base = [], []
    try:
        with Sandbox.create(env, store=store, node_dir=node / "base", limits=LIMITS) as b:
            for _ in range(3):
                t = time.perf_counter()
                sb.files.write("/tmp/blob", data)
                got = sb.files.read("/tmp/blob", format="bytes")
                e2b.append(time.perf_counter() - t)
                assert got == data
                t = time.perf_counter()
                b.write_file("/tmp/blob", data)
                got = b.read_file("/tmp/blob")
                base.append(time.perf_counter() - t)
                assert got == data
    finally:
        sb.kill()
    return 2 * mib / min(e2b), 2 * mib / min(base)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default=os.environ.get("ENVBUILD_STORE"))
    ap.add_argument("--env", default="busybox-shell")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--execs", type=int, default=200)
    ap.add_argument("--concurrent", type=int, default=100)
    ap.add_argument("--mib", type=int, default=10)
    ap.add_argument("--only", default=",".join(PARTS), metavar="PART,...",
                    help=f"the parts to run, of {','.join(PARTS)}")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if not only <= set(PARTS):
        raise SystemExit(f"--only: unknown part {sorted(only - set(PARTS))}; parts: {PARTS}")
    if not args.store:
        raise SystemExit("no store: pass --store DIR or set ENVBUILD_STORE")
    store = os.path.abspath(args.store)
    with tempfile.TemporaryDirectory(prefix="e2b-bench-") as tmp:
        root = Path(tmp)
        node = root / "node"
        proc, url, key = start_server(root, store, node)
        os.environ.update({"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key})
        try:
            lifecycle(args.env, store, node, 2)  # warm: caches, the e2b client, the server
            if "lifecycle" in only:
                e2b, base = lifecycle(args.env, store, node, args.runs)
                print(f"lifecycle create→run(true)→kill p50: e2b {p50_ms(e2b):.1f} ms, "
                      f"runtime_shim {p50_ms(base):.1f} ms, "
                      f"ratio {p50_ms(e2b) / p50_ms(base):.2f} (goal <= 1.5)")
            if "roundtrip" in only:
                e2b, base = round_trips(args.env, store, node, args.execs)
                print(f"commands.run round trip p50: {p50_ms(e2b):.2f} ms (goal <= 3); "
                      f"runtime_shim exec {p50_ms(base):.2f} ms")
            if "concurrent" in only:
                errors, seconds, first = concurrent_creates(args.env, args.concurrent)
                print(f"{args.concurrent} concurrent async creates: {errors} errors (goal 0), "
                      f"{seconds:.1f} s {first}")
            if "files" in only:
                e2b_rate, base_rate = files(args.env, store, node, args.mib)
                print(f"files write+read {args.mib} MiB: e2b {e2b_rate:.0f} MiB/s, "
                      f"runtime_shim {base_rate:.0f} MiB/s, ratio {e2b_rate / base_rate:.2f} "
                      f"(goal >= 0.5)")
            print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        finally:
            proc.terminate()
            proc.wait(120)
        left = list_sandboxes(node)
        if proc.returncode != 0 or left:
            print(f"server exit {proc.returncode}, sandboxes left: {[s.id for s in left]}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
