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
4. ``files.write`` + ``files.read`` of ``--mib`` MiB (bytes in, ``format="bytes"`` out; the
   SDK's default multipart upload, the goal's figure, and its octet-stream upload): throughput
   against ``Sandbox.write_file`` + ``read_file`` (best of 9 each, interleaved), and per round
   trip the e2b client's own CPU, the server's CPU and the baseline's whole time. Goal: ratio
   >= 0.5.

``--only files`` (or ``lifecycle``, ``roundtrip``, ``concurrent``, comma-separated) runs those
parts only. Prints one line per figure and the load average; exits 1 if the server leaves a sandbox.
Needs root, runc and ``ENV`` built in the store (``$ENVBUILD_STORE`` unless ``--store``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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


def _cpu() -> float:
    """This process's CPU seconds, all threads (the e2b client's transport runs its own)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Trips:
    """Round trips of one way of moving the file: wall, client CPU, server CPU (seconds)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.client: list[float] = []
        self.server: list[float] = []

    def time(self, server_pid: int | None, fn: Callable[[], None]) -> None:
        s0 = _proc_cpu(server_pid) if server_pid else 0.0
        c0, t0 = _cpu(), time.perf_counter()
        fn()
        self.wall.append(time.perf_counter() - t0)
        self.client.append(_cpu() - c0)
        self.server.append(_proc_cpu(server_pid) - s0 if server_pid else 0.0)

    def rate(self, mib: int) -> float:
        return 2 * mib / min(self.wall)


def files(env: str, store: str, node: Path, mib: int, server_pid: int, runs: int = 9
          ) -> dict[str, Trips]:
    """Write + read round trips, interleaved: the SDK's default for bytes (multipart upload,
    ``format="bytes"`` download), its octet-stream upload (``use_octet_stream=True``, a
    documented option) and ``runtime_shim``'s ``write_file`` + ``read_file``."""
    from e2b import Sandbox as E2bSandbox

    data = os.urandom(mib << 20)
    sb = E2bSandbox.create(env)
    trips = {"e2b": Trips(), "e2b-octet": Trips(), "runtime_shim": Trips()}

    def e2b(octet: bool) -> None:
        sb.files.write("/tmp/blob", data, use_octet_stream=octet or None)
        assert sb.files.read("/tmp/blob", format="bytes") == data

    def base() -> None:
        b.write_file("/tmp/blob", data)
        assert b.read_file("/tmp/blob") == data

    try:
        with Sandbox.create(env, store=store, node_dir=node / "base", limits=LIMITS) as b:
            for _ in range(runs):
                trips["e2b"].time(server_pid, lambda: e2b(False))
                trips["e2b-octet"].time(server_pid, lambda: e2b(True))
                trips["runtime_shim"].time(None, base)
    finally:
        sb.kill()
    return trips


def print_files(trips: dict[str, Trips], mib: int) -> None:
    """The throughput ratio (goal: the SDK's default), and where the time goes. CPU figures
    are means (the server's is read in 10 ms ticks). A round trip cannot take less wall than
    the client's CPU, nor than the client's and the server's CPU spread over all cores: the
    ratio those allow against the baseline's median round trip is printed as the bound."""
    base = trips["runtime_shim"]
    base_ms = statistics.median(base.wall) * 1000
    cores = os.cpu_count() or 1
    for name in ("e2b", "e2b-octet"):
        t = trips[name]
        wall_ms = statistics.median(t.wall) * 1000
        client_ms, server_ms = statistics.mean(t.client) * 1000, statistics.mean(t.server) * 1000
        floor_ms = max(client_ms, server_ms, (client_ms + server_ms) / cores)
        print(f"files write+read {mib} MiB ({name}): {t.rate(mib):.0f} MiB/s, runtime_shim "
              f"{base.rate(mib):.0f} MiB/s, ratio {t.rate(mib) / base.rate(mib):.2f}"
              f"{' (goal >= 0.5)' if name == 'e2b' else ''}")
        print(f"  per round trip: wall {wall_ms:.1f} ms (median), e2b client CPU "
              f"{client_ms:.1f} ms ({100 * client_ms / wall_ms:.0f}% of it), server CPU "
              f"{server_ms:.1f} ms; runtime_shim wall {base_ms:.1f} ms (CPU "
              f"{statistics.mean(base.client) * 1000:.1f}); the client's CPU alone caps the "
              f"ratio at {base_ms / client_ms:.2f}, client + server CPU on {cores} cores at "
              f"{base_ms / floor_ms:.2f}")


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
                print_files(files(args.env, store, node, args.mib, proc.pid), args.mib)
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
