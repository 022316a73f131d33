#!/usr/bin/env python3
"""A PTY keystroke's echo round trip, against a pipe round trip measured in the same run.

    .venv/bin/python benchmarks/pty_echo.py [--store cache] [--keys 300] [--serve]

1. ``Sandbox.start("cat", pty=(24, 80))``: one byte written to the terminal, timed until the
   terminal's echo of it comes back to ``on_stdout`` (host → agent → line discipline → agent →
   host); the baseline, interleaved key by key: ``Sandbox.start("cat")`` on pipes, one line
   written and timed until ``cat`` writes it back. p50 / p90 of each and their ratio.
2. ``--serve``: a keystroke through ``envbuild serve`` and the unmodified ``e2b`` SDK
   (``sandbox.pty.create``: the SDK's interactive shell, whose line editor echoes; then
   ``sandbox.pty.send_stdin`` → the ``on_data`` stream), against ``commands.send_stdin`` to a
   ``cat`` on pipes, interleaved.

Prints the load average beside the figures (the host is shared). Needs root, runc, the
busybox env (built into ``--store`` if missing) and, for ``--serve``, ``envbuild[serve]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _envs import ensure_built  # noqa: E402
from _stats import pct  # noqa: E402

from envbuild.store import LocalStore  # noqa: E402
from runtime_shim import Sandbox  # noqa: E402

ENV = "busybox-shell"


class Echo:
    """Bytes from a stream, and a wait until ``n`` more of them arrived."""

    def __init__(self) -> None:
        self.got = 0
        self.cond = threading.Condition()

    def feed(self, data: bytes) -> None:
        with self.cond:
            self.got += len(data)
            self.cond.notify_all()

    def round_trip(self, send: Callable[[], None], n: int) -> float:
        with self.cond:
            want = self.got + n
        started = time.perf_counter()
        send()
        with self.cond:
            if not self.cond.wait_for(lambda: self.got >= want, 10):
                raise SystemExit("no echo within 10 s")
        return time.perf_counter() - started


def _report(name: str, pty: list[float], pipe: list[float]) -> None:
    p50, b50 = pct(pty, 50) * 1e3, pct(pipe, 50) * 1e3
    print(f"{name}: PTY echo p50 {p50:.2f} ms p90 {pct(pty, 90) * 1e3:.2f} ms | pipe p50 "
          f"{b50:.2f} ms p90 {pct(pipe, 90) * 1e3:.2f} ms | ratio {p50 / b50:.2f} "
          f"(load {os.getloadavg()[0]:.1f}, n={len(pty)})", flush=True)


def sdk(store: Path, node: Path, keys: int) -> None:
    with Sandbox.create(ENV, store=LocalStore(store), node_dir=node) as sb:
        term, pipe = Echo(), Echo()
        tproc = sb.start(["cat"], pty=(24, 80), on_stdout=term.feed)
        pproc = sb.start(["cat"], on_stdout=pipe.feed)
        pty_times, pipe_times = [], []
        for i in range(keys + 20):
            t = term.round_trip(lambda: tproc.write_stdin(b"x"), 1)
            p = pipe.round_trip(lambda: pproc.write_stdin(b"x\n"), 2)
            if i >= 20:  # warm-up
                pty_times.append(t)
                pipe_times.append(p)
        tproc.kill()
        pproc.kill()
        _report("runtime_shim", pty_times, pipe_times)


@contextlib.contextmanager
def _server(store: Path, node: Path, root: Path) -> Iterator[str]:
    keys = root / "keys"
    keys.write_text("bench-key\n")
    log = root / "serve.log"
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(node), "ENVBUILD_STORE": str(store),
           "PYTHONPATH": str(REPO)}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "envbuild.cli", "serve", "--listen",
                                 "127.0.0.1:0", "--api-keys", str(keys)], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "envbuild serve: http" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"envbuild serve did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield log.read_text().split("envbuild serve: ", 1)[1].split()[0]
    finally:
        proc.terminate()
        proc.wait(60)


def _in_thread(fn: Callable[[], object]) -> None:
    """``fn`` in a daemon thread; its stream breaking off when the sandbox is killed at the
    end is expected."""
    def run() -> None:
        with contextlib.suppress(Exception):
            fn()

    threading.Thread(target=run, daemon=True).start()


def serve(store: Path, node: Path, keys: int, root: Path) -> None:
    with _server(store, node, root) as url:
        os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY="bench-key")
        from e2b import Sandbox as E2BSandbox
        from e2b.sandbox.commands.command_handle import PtySize

        sb = E2BSandbox.create(ENV, timeout=600)
        try:
            term, pipe = Echo(), Echo()
            handle = sb.pty.create(PtySize(24, 80), timeout=0)
            _in_thread(lambda: handle.wait(on_pty=term.feed))
            cat = sb.commands.run("cat", background=True, stdin=True, timeout=0)
            # (the sync SDK delivers output to whoever iterates the handle)
            _in_thread(lambda: cat.wait(on_stdout=lambda s: pipe.feed(s.encode())))
            pty_times, pipe_times = [], []
            for i in range(keys + 20):
                t = term.round_trip(lambda: sb.pty.send_stdin(handle.pid, b"x"), 1)
                p = pipe.round_trip(lambda: sb.commands.send_stdin(cat.pid, "x\n"), 2)
                if i >= 20:
                    pty_times.append(t)
                    pipe_times.append(p)
            _report("envbuild serve + e2b SDK", pty_times, pipe_times)
        finally:
            sb.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", type=Path, default=REPO / "cache")
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--serve", action="store_true", help="also through envbuild serve")
    args = ap.parse_args()
    ensure_built(args.store, ENV)
    with tempfile.TemporaryDirectory(prefix="pty-echo-") as tmp:
        node = Path(tmp) / "node"
        sdk(args.store, node, args.keys)
        if args.serve:
            serve(args.store, node, args.keys, Path(tmp))


if __name__ == "__main__":
    main()
