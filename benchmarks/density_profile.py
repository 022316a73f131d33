#!/usr/bin/env python3
"""Where a create's time goes against the sandboxes already alive (issue 39, item 1).

    .venv/bin/python benchmarks/density_profile.py [--levels 100,1500] [--probe 30]
        [--strace N] [--perf]

Idle busybox sandboxes are added up to each level of ``--levels``; at each level ``--probe``
create → exec lifecycles are timed step by step (each step a wrapper around the function that
does it: the store lookup, the ledger, the disk, the bundle, the overlay, ``runc run``, the
agent's first answer, the exec), and the median of each step printed beside the first level's.
``--strace N``: the last N probes of each level run ``runc run`` under ``strace -f -c``
(syscall time summed over the N) and the syscalls whose time grew most are printed.
``--perf``: ``perf record -a -g`` during each level's probes, its top symbols printed.
Every sandbox is closed at the end.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from envbuild.libc import LIBC  # noqa: E402
from runtime_shim import Limits, Sandbox  # noqa: E402
from runtime_shim.backends import container  # noqa: E402
from runtime_shim.isolation import agent, cpuclass, mountns  # noqa: E402
from runtime_shim.node import diskpool, ledger  # noqa: E402
from runtime_shim.sdk import sandbox as sdk_sandbox  # noqa: E402

ENV = "env/busybox-shell"
STEPS: dict[str, list[float]] = collections.defaultdict(list)
_current: dict[str, float] = collections.defaultdict(float)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _current[name] += time.perf_counter() - t
    return wrapper


def instrument() -> None:
    """Wrap each step of a create where the create path looks it up."""
    for owner, attr, name in [
        (sdk_sandbox, "resolve", "resolve"),
        (sdk_sandbox, "layer_dirs", "layer dirs"),
        (sdk_sandbox.owners, "register", "owners"),
        (sdk_sandbox, "write_record", "records"),
        (ledger.Ledger, "admit", "ledger admit"),
        (diskpool, "create_disk", "disk"),
        (agent, "agent_binary", "agent binary"),
        (container.ContainerSandbox, "_write_spec", "spec+bundle"),
        (mountns, "in_own_mount_ns", "mountns thread"),
        (mountns, "_enter_private_namespace", "unshare ns"),
        (container, "mount_overlay", "overlay mount"),
        (container, "_spawn_with_fd", "runc run"),
        (container, "_init_pid", "init pid"),
        (cpuclass, "apply", "cpu class"),
        (container.ContainerSandbox, "_wait_for_agent", "agent hello"),
    ]:
        setattr(owner, attr, _timed(name, getattr(owner, attr)))


_STRACE: dict[str, Any] = {"out": None}


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _stop_strace_after_runc(pid_file: Path) -> None:
    """Once ``runc run`` has written the pid file and exited (strace has no child left: the
    container's init is not its child), interrupt strace (``-I 1``): it detaches from the
    container's processes, which live on."""
    deadline = time.monotonic() + 30
    strace = None
    while time.monotonic() < deadline:
        if strace is None:
            strace = next((c for c in _children(os.getpid())
                           if Path(f"/proc/{c}/comm").read_text().strip() == "strace"), None)
        elif pid_file.exists() and not _children(strace):
            os.kill(strace, 15)
            return
        time.sleep(0.002)


def _strace_spawn(original: Callable[..., int]) -> Callable[..., int]:
    """``runc run`` under ``strace -f -c`` while ``_STRACE["out"]`` names a file."""
    def spawn(argv: list[str], stderr_fd: int, pass_fd: int) -> int:
        out = _STRACE["out"]
        if out is None:
            return original(argv, stderr_fd, pass_fd)
        n = len(list(Path(out).parent.glob(Path(out).name + "*")))
        pid_file = Path(argv[argv.index("--pid-file") + 1])
        watcher = threading.Thread(target=_stop_strace_after_runc, args=(pid_file,))
        watcher.start()
        original(["strace", "-I", "1", "-f", "-T", "-o", f"{out}.{n}", *argv], stderr_fd,
                 pass_fd)
        watcher.join()
        return 0
    return spawn


_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()")
_DURATION = re.compile(r"<([\d.]+)>$")


def strace_totals(prefix: str) -> dict[str, tuple[int, float]]:
    """syscall → (calls, seconds) summed over the traces ``prefix.*`` (``strace -f -T``); a
    call on a path under ``/sys/fs/cgroup`` counts as ``<name>:cgroup``."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for f in Path(prefix).parent.glob(Path(prefix).name + ".*"):
        pending: dict[str, str] = {}
        for line in f.read_text(errors="replace").splitlines():
            m = _LINE.match(line)
            if m is None:
                continue
            pid, resumed, name = m.groups()
            if name is not None:
                name += ":cgroup" if "/sys/fs/cgroup" in line else ""
                if line.endswith("<unfinished ...>"):
                    pending[pid] = name
                    continue
            else:
                name = pending.pop(pid, resumed)
            d = _DURATION.search(line)
            if d is not None:
                totals[name][0] += 1
                totals[name][1] += float(d.group(1))
    return {k: (int(v[0]), v[1]) for k, v in totals.items()}


@contextlib.contextmanager
def perf_record(out: Path) -> Iterator[None]:
    proc = subprocess.Popen(["perf", "record", "-a", "-g", "-F", "499", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.send_signal(2)
        proc.wait()


def perf_top(out: Path, n: int = 25) -> str:
    done = subprocess.run(["perf", "report", "-i", str(out), "--no-children", "--sort",
                           "comm,sym", "--stdio", "-g", "none", "--percent-limit", "0.7"],
                          capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    return "\n".join(lines[:n])


def probe(args: argparse.Namespace, store: str, node: Path, limits: Limits, live: list[Sandbox],
          level: str, tmp: Path) -> dict[str, float]:
    rows: dict[str, list[float]] = collections.defaultdict(list)
    for i in range(args.probe):
        if args.strace and i >= args.probe - args.strace:
            _STRACE["out"] = str(tmp / f"strace-{level}")
        _current.clear()
        t = time.perf_counter()
        sb = Sandbox.create(ENV, store=store, node_dir=node, limits=limits)
        created = time.perf_counter()
        sb.exec(["true"])
        end = time.perf_counter()
        _STRACE["out"] = None
        live.append(sb)
        if args.strace and i >= args.probe - args.strace:
            continue  # strace's own cost is not a step's
        for k, v in _current.items():
            rows[k].append(v)
        rows["exec"].append(end - created)
        rows["create"].append(created - t)
        rows["create+exec"].append(end - t)
    return {k: statistics.median(v) * 1e3 for k, v in rows.items()}


class _OsWithRusage:
    """``os`` for the container module, whose ``waitpid`` (of ``runc run``) also records the
    CPU time of runc and the children it waited for (``runc run cpu``)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def waitpid(pid: int, options: int) -> tuple[int, int]:
        got, status, usage = os.wait4(pid, options)
        _current["runc run cpu"] += usage.ru_utime + usage.ru_stime
        return got, status


def _hierarchies() -> list[Path]:
    """The mount point of every cgroup hierarchy (v1 ones and the cgroup2 one)."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[:1] in (["cgroup"], ["cgroup2"]):
            out.append(Path(left.split()[4]))
    return out


def kernel_probe(n: int, per_hierarchy: bool = True) -> dict[str, float]:
    """What the kernel's steps of a container start cost here (p50 ms over ``n``): a cgroup
    dir made in every hierarchy, a process moved into each and back, the dirs removed; a new
    network namespace; a new mount namespace (in a forked child)."""
    from runtime_shim.isolation.cgroupfs import PARENT

    rows: dict[str, list[float]] = collections.defaultdict(list)
    sleeper = subprocess.Popen(["sleep", "600"])
    home = {}
    for line in Path(f"/proc/{sleeper.pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        home[names] = path
    points = _hierarchies()
    made: list[Path] = []
    try:
        for i in range(n):
            dirs = [h / PARENT / f"eb-probe-{os.getpid()}-{i}" for h in points]
            t = time.perf_counter()
            made.extend(dirs)
            for d in dirs:
                m = time.perf_counter()
                d.mkdir()
                if (d / "cpuset.cpus").exists():  # empty in a new cpuset: runc copies them too
                    for f in ("cpuset.cpus", "cpuset.mems"):
                        (d / f).write_text((d.parent / f).read_text())
                if per_hierarchy:
                    rows[f"k: mkdir {d.parent.parent.name}"].append(time.perf_counter() - m)
            time.sleep(0.02)  # the cgroup rwsem's fast mode back (its first writer waits a GP)
            t1 = time.perf_counter()
            for d in dirs:
                m = time.perf_counter()
                (d / "cgroup.procs").write_text(str(sleeper.pid))
                if per_hierarchy:
                    rows[f"k: attach {d.parent.parent.name}"].append(time.perf_counter() - m)
            t2 = time.perf_counter()
            for h in points:  # back where it was
                key = next((k for k in home if h.name in k.split(",") or
                            (k == "" and h.name == "unified") or
                            (k == "name=systemd" and h.name == "systemd")), None)
                if key is not None:
                    (h / home[key].lstrip("/") / "cgroup.procs").write_text(str(sleeper.pid))
            t3 = time.perf_counter()
            for d in dirs:
                d.rmdir()
                made.remove(d)
            t4 = time.perf_counter()
            rows[f"k: cgroup mkdir x{len(dirs)}"].append(t1 - t)
            rows[f"k: cgroup attach x{len(dirs)}"].append(t2 - t1)
            rows["k: cgroup detach"].append(t3 - t2)
            rows["k: cgroup rmdir"].append(t4 - t3)
            rows["k: rcu grace period"].append(_grace_period())
            for flag, name in ((0x40000000, "netns"), (0x00020000, "mntns"),
                               (0x20000000 | 0x00020000, "pidns+mntns")):
                rows[f"k: unshare {name}"].append(_unshare_in_child(flag))
    finally:
        sleeper.kill()
        sleeper.wait()
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
    return {k: statistics.median(v) * 1e3 for k, v in rows.items()}


def _grace_period() -> float:
    """Seconds of one RCU grace period: ``membarrier(MEMBARRIER_CMD_GLOBAL)`` is a
    ``synchronize_rcu()``."""
    t = time.perf_counter()
    LIBC.syscall(324, 1, 0, 0)  # SYS_membarrier on x86_64
    return time.perf_counter() - t


def _unshare_in_child(flags: int) -> float:
    """Seconds a forked child took to unshare ``flags`` (then it exits)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no Python objects touched beyond this
        t = time.perf_counter()
        rc = LIBC.unshare(flags)
        os.write(w, f"{time.perf_counter() - t if rc == 0 else -1.0}".encode())
        os._exit(0)
    os.close(w)
    took = float(os.read(r, 64) or b"-1")
    os.close(r)
    os.waitpid(pid, 0)
    return took


def perf_comms(data: Path, probes: int) -> dict[str, float]:
    """Samples per probe by command (runc's processes and this one), from ``perf report``."""
    done = subprocess.run(["perf", "report", "-i", str(data), "-n", "--sort", "comm", "--stdio",
                           "-g", "none"], capture_output=True, text=True)
    out: dict[str, float] = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].endswith("%") and parts[1].isdigit():
            out[" ".join(parts[2:])] = int(parts[1]) / probes
    return out


def run_rounds(args: argparse.Namespace, store: str, node: Path, limits: Limits, tmp: Path
               ) -> dict[str, dict[str, float]]:
    live: list[Sandbox] = []
    results: dict[str, dict[str, float]] = {}
    try:
        for i, level in enumerate(int(x) for x in args.levels.split(",")):
            while len(live) < level - args.probe:
                live.append(Sandbox.create(ENV, store=store, node_dir=node, limits=limits))
            while len(live) > max(0, level - args.probe):
                live.pop().close()
            name = f"{level}#{i}"
            data = tmp / f"perf-{i}.data"
            with perf_record(data) if args.perf else contextlib.nullcontext():
                results[name] = probe(args, store, node, limits, live, name, tmp)
            if args.kernel:
                results[name].update(kernel_probe(args.kernel))
            if args.perf:
                results[name].update({f"perf {k}": v for k, v in perf_comms(data, args.probe).items()
                                      if "runc" in k})
            print(f"round {name}: {len(live)} live, load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        started, n = time.monotonic(), len(live)
        for sb in live:
            sb.close()
        if n:
            print(f"close: {(time.monotonic() - started) / n * 1e3:.1f} ms per sandbox at {n}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="100,1500,100,1500")
    parser.add_argument("--probe", type=int, default=30)
    parser.add_argument("--strace", type=int, default=0)
    parser.add_argument("--perf", action="store_true")
    parser.add_argument("--kernel", type=int, default=0,
                        help="also time the kernel's steps (cgroups, namespaces) N times a round")
    parser.add_argument("--pids", type=int, default=8)
    parser.add_argument("--root", default=None)
    args = parser.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-density-"))
    tmp = Path(tempfile.mkdtemp(prefix="density-profile-"))
    if not (root / "store").exists():
        from tests.integration.conftest import build_busybox_env

        build_busybox_env(root)
    instrument()
    container.os = _OsWithRusage()  # type: ignore[assignment]
    if args.strace:
        container._spawn_with_fd = _strace_spawn(container._spawn_with_fd)
    limits = Limits(disk_bytes=None, memory_bytes=32 << 20, pids=args.pids, nofile=64)
    results = run_rounds(args, str(root / "store"), root / "node", limits, tmp)
    rounds = list(results)
    names = sorted({k for r in results.values() for k in r},
                   key=lambda k: -results[rounds[-1]].get(k, 0))
    print(f"{'step (p50 ms)':<24}" + "".join(f"{r:>9}" for r in rounds))
    for k in names:
        print(f"{k:<24}" + "".join(f"{results[r].get(k, 0.0):9.2f}" for r in rounds))
    if args.strace:
        print_strace(tmp, rounds[0], rounds[1], args.strace)
    return 0


def print_strace(tmp: Path, a: str, b: str, n: int) -> None:
    first, last = strace_totals(str(tmp / f"strace-{a}")), strace_totals(str(tmp / f"strace-{b}"))
    print(f"strace of runc run, per run (of {n}): syscall calls/ms at {a} → {b}")
    grown = sorted(last, key=lambda k: -(last[k][1] - first.get(k, (0, 0.0))[1]))
    for k in grown[:20]:
        c0, s0 = first.get(k, (0, 0.0))
        c1, s1 = last[k]
        print(f"  {k:<22} {c0 / n:7.1f} {s0 / n * 1e3:8.3f}  →  {c1 / n:7.1f} {s1 / n * 1e3:8.3f}")


if __name__ == "__main__":
    sys.exit(main())
