#!/usr/bin/env python3
"""Soak (issue 34): sandbox lifecycles on one node while faults are injected at random, with
the node's invariants checked after every phase.

    .venv/bin/python benchmarks/soak.py [--phases 4] [--lifecycles 200] [--workers 3]
        [--vms 2] [--no-lazy] [--seed N] [--store DIR] [--json]

Each phase runs ``--lifecycles`` create → exec → check → close cycles spread over worker
processes (full-pull and lazy containers, FnCall calls, and ``--vms`` microVMs per phase),
next to one hostile tenant (a fork bomb, an output flood, a disk fill, inside its limits),
while a fault is injected every second or so, chosen at random:

- ``kill-creator``: SIGKILL a worker mid-lifecycle (its sandboxes must go: the exit watcher);
- ``kill-runc``: SIGKILL a ``runc`` working for this node;
- ``kill-filler-worker``: SIGKILL the worker of the node's native lazy filler (its holder
  starts a new one; readers of unfilled files wait, never read zeros);
- ``store-away``: the store directory disappears for two seconds;
- ``disk-nearly-full``: the node's filesystem (an ext4 image of the soak's own, so the host's
  disk is never at risk) is filled to 32 MiB of free space for three seconds.

A lifecycle ends ``ok`` (its output is exactly what was asked for), ``error`` (an exception, a
refusal: expected under faults) or ``wrong`` (an exit 0 with other output: never allowed). After
each phase every sandbox is closed or collected (``gc_sandboxes``, unused native lazy layers unmounted)
and the node is checked: no mount (a sandbox's network namespace is one), loop device, process
(slirp4netns, runc, QEMU, agents, watchers, the filler), new sandbox cgroup, sandbox dir or
admission reservation of the soak may be left. It prints lifecycles per second, the faults
injected and the leaks found (goal: 0 wrong, 0 leaks); exit 1 if either is not 0.

A fleet daemon is not among the faults here (a Ray cluster costs ~1 GB and its own minutes on a
2-core host): ``tests/integration/test_fleet.py`` kills fleet daemons. Needs root, runc, QEMU
for ``--vms``, and the busybox env (built into ``--store`` first if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

ENV = "env/busybox-shell"
KINDS = ("full", "lazy", "fncall")
FAULTS = ("kill-creator", "kill-runc", "kill-filler-worker", "store-away", "disk-nearly-full")
NODE_IMAGE_SIZE = 3 << 30
ERROR_BACKOFF = 0.5   # seconds a worker waits after a failed lifecycle
# small sandboxes: a phase's worth fits the soak's own node filesystem and budget
LIMITS = {"disk_bytes": 64 << 20, "inodes": 20_000, "pids": 64, "nofile": 256,
          "memory_bytes": 128 << 20}


# -- one worker: lifecycles of one kind, one JSON line each --------------------------------------

def _expected(nonce: str) -> bytes:
    return f"{nonce}\n42\n".encode()


def _command(nonce: str) -> str:
    return f"echo {nonce}; echo $((6 * 7))"


def worker(kind: str, count: int, store: str, node: str, seed: int, out: str) -> None:
    from runtime_shim.node.model import Limits
    from runtime_shim.sdk.sandbox import Sandbox

    rng = random.Random(seed)
    # a microVM's guest kernel needs more memory than a container's shell
    limits = Limits(**{**LIMITS, **({"memory_bytes": 256 << 20} if kind == "vm" else {})})
    pool = None
    with open(out, "a", buffering=1) as log:
        for _ in range(count):
            nonce = f"n{rng.getrandbits(48):012x}"
            t0 = time.monotonic()
            rec: dict = {"kind": kind}
            try:
                if kind == "fncall":
                    if pool is None:
                        from runtime_shim.sdk.fnpool import FnPool

                        pool = FnPool(ENV, size=1, store=store, node_dir=node, limits=limits)
                    r = pool.call(_command(nonce), timeout=60)
                else:
                    backend = "microvm" if kind == "vm" else "container"
                    with Sandbox.create(ENV, store=store, node_dir=node, backend=backend,
                                        lazy=kind == "lazy",
                                        limits=limits) as sb:
                        r = sb.exec(_command(nonce), timeout=60)
                if r.exit_code == 0 and r.stdout == _expected(nonce):
                    rec["result"] = "ok"
                elif r.exit_code == 0:
                    rec.update(result="wrong", stdout=r.stdout[:200].decode(errors="replace"))
                else:
                    rec.update(result="error", error=f"exit {r.exit_code}: "
                               f"{r.stderr[-200:].decode(errors='replace')}")
            except Exception as e:  # noqa: BLE001 - every failure is a counted outcome
                rec.update(result="error", error=f"{type(e).__name__}: {str(e)[:200]}")
            rec["seconds"] = round(time.monotonic() - t0, 3)
            log.write(json.dumps(rec) + "\n")
            if rec["result"] == "error":   # a harness backs off: a fault lasting seconds must
                time.sleep(ERROR_BACKOFF)  # not use up the lifecycles in refusals
    if pool is not None:
        pool.close()


# -- the node the soak owns: an ext4 image, so "disk nearly full" is safe --------------------------

class SoakNode:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.image = base / "node.ext4"
        self.dir = base / "node"
        self.dir.mkdir()
        with open(self.image, "wb") as f:
            f.truncate(NODE_IMAGE_SIZE)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(self.image)], check=True)
        subprocess.run(["mount", "-o", "loop", str(self.image), str(self.dir)], check=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.dir)], check=False)


# -- faults ---------------------------------------------------------------------------------------

def _pids_naming(text: str, *, program: bytes = b"", arg: bytes = b"") -> list[int]:
    """Processes whose command line names ``text``, whose program (``argv[0]``) holds
    ``program`` and one of whose arguments holds ``arg``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if text.encode() in b"\0".join(argv) and program in argv[0] \
                and any(arg in a for a in argv[1:]):
            found.append(int(entry.name))
    return found


def inject(fault: str, rng: random.Random, node: SoakNode, store: Path,
           workers: list[subprocess.Popen]) -> bool:
    """Inject ``fault``; whether there was something to inject it into."""
    if fault == "kill-creator":
        alive = [w for w in workers if w.poll() is None]
        if not alive:
            return False
        rng.choice(alive).send_signal(signal.SIGKILL)
        return True
    if fault in ("kill-runc", "kill-filler-worker"):
        pids = (_pids_naming(str(node.dir), program=b"runc") if fault == "kill-runc"
                else _pids_naming(str(node.dir / "node"), arg=b"--worker"))
        for pid in pids[:1]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return bool(pids)
    if fault == "store-away":
        away = store.with_name(store.name + ".away")
        store.rename(away)
        time.sleep(2)
        away.rename(store)
        return True
    if fault == "disk-nearly-full":
        st = os.statvfs(node.dir)
        free = st.f_bavail * st.f_frsize
        filler = node.dir / "soak-filler"
        if free <= 64 << 20:
            return False
        subprocess.run(["fallocate", "-l", str(free - (32 << 20)), str(filler)], check=False)
        time.sleep(3)
        filler.unlink(missing_ok=True)
        return True
    raise ValueError(fault)


# -- the hostile tenant -----------------------------------------------------------------------------

HOSTILE = [
    ":(){ :|:& };: ; sleep 2",                                   # fork bomb (pids limit)
    "i=0; while [ $i -lt 200000 ]; do echo x; i=$((i+1)); done",  # output flood, tiny writes
    "dd if=/dev/zero of=/fill bs=1M count=1000 2>&1; sync",      # disk fill (disk limit)
]


def hostile_tenant(store: str, node: str, rounds: int) -> subprocess.Popen:
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from runtime_shim.node.model import Limits\n"
            "from runtime_shim.sdk.sandbox import Sandbox\n"
            f"with Sandbox.create({ENV!r}, store={store!r}, node_dir={node!r}, "
            f"limits=Limits(**{LIMITS!r})) as sb:\n"
            f"    for cmd in {HOSTILE!r} * {rounds}:\n"
            "        try:\n"
            "            sb.exec(cmd, timeout=30)\n"
            "        except Exception as e:\n"
            "            print(type(e).__name__, e, file=sys.stderr)\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


# -- invariants -------------------------------------------------------------------------------------

def settle(node: Path) -> None:
    """Close what the phase left: crashed owners' sandboxes (their exit watchers first, then
    ``gc_sandboxes``), unused native lazy layers (the filler stops with the last); then wait
    (bounded) for the node's helper processes — exit watchers, the filler — to end."""
    from runtime_shim.node.nodecache import NodeCache
    from runtime_shim.sdk.sandbox import gc_sandboxes, layers_in_use
    from tests.leftovers import processes_under

    deadline = time.monotonic() + 30
    while _sandbox_dirs(node) and time.monotonic() < deadline:
        time.sleep(0.5)
    gc_sandboxes(node)
    NodeCache(node / "node").evict(layers_in_use(node), 0)
    deadline = time.monotonic() + 30
    while processes_under(node) and time.monotonic() < deadline:
        time.sleep(0.5)


def _shares_our_mounts(entry: str, node: Path) -> bool:
    pid, _, cmdline = entry.partition(" ")
    try:
        same = os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt")
    except OSError:
        return True   # gone meanwhile
    return same and str(node) not in cmdline


def _sandbox_dirs(node: Path) -> list[str]:
    d = node / "sandboxes"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def sandbox_cgroups() -> set[str]:
    """Every sandbox cgroup (``/envbuild/eb-*`` in any hierarchy) on the host."""
    found = set()
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        parent = hierarchy / "envbuild"
        if parent.is_dir():
            found |= {str(p) for p in parent.iterdir() if p.name.startswith("eb-")}
    return found


def leaks(node: Path, cgroups_before: set[str]) -> dict[str, list[str]]:
    """What the phase left on the node: mounts (the node's own filesystem aside), loop devices,
    processes, sandbox dirs, admission reservations, and sandbox cgroups that were not there
    before the phase (run the soak on a node nothing else creates sandboxes on)."""
    from tests.leftovers import leftovers_under

    found = leftovers_under(node)
    found["mounts"] = [m for m in found["mounts"] if m != str(node)]
    # a process of this mount namespace lists a leaked mount in its mount table too: that is
    # the mount's leak, counted once above, not the process's
    found["processes"] = [p for p in found["processes"] if not _shares_our_mounts(p, node)]
    found["sandbox dirs"] = _sandbox_dirs(node)
    from runtime_shim.node.diskpool import POOL_KEY
    from runtime_shim.node.ledger import Ledger

    # the node's disk pool is the node's, not the phase's: its image (and so its reservation)
    # stays when its last sandbox is gone, unmounted (runtime_shim.node.diskpool)
    found["admission reservations"] = sorted(k for k in Ledger(node / "node").reserved()
                                             if k != POOL_KEY)
    found["cgroups"] = sorted(sandbox_cgroups() - cgroups_before)
    return {k: v for k, v in found.items() if v}


# -- the driver -------------------------------------------------------------------------------------

def _top_errors(records: list[dict], n: int = 4) -> list[tuple[str, int]]:
    """The commonest error messages (numbers and ids blanked out so alike ones group)."""
    import collections
    import re

    shapes = collections.Counter(re.sub(r"[0-9a-f]{6,}|\d+", "#", x.get("error", ""))[:120]
                                 for x in records if x["result"] == "error")
    return shapes.most_common(n)


def _record(line: str) -> dict:
    """One lifecycle's record; a line cut short by a SIGKILL mid-write is an error."""
    try:
        return json.loads(line)
    except ValueError:
        return {"kind": "?", "result": "error", "error": "record cut short by a kill"}


class Worker:
    """One worker process of a phase and the lifecycles it still owes: one killed by a fault
    is replaced by another for the rest (``respawn``), so a phase runs all it planned."""

    def __init__(self, kind: str, count: int, out: Path, args, node: SoakNode, store: Path,
                 seed: int) -> None:
        self.kind, self.count, self.out = kind, count, out
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", kind, "--count", str(count), "--store",
             str(store), "--node", str(node.dir), "--seed", str(seed), "--out", str(out)],
            start_new_session=True)

    def done(self) -> int:
        return len(self.out.read_text().splitlines()) if self.out.exists() else 0

    def respawn(self, args, node: SoakNode, store: Path, seed: int) -> Worker | None:
        """A replacement for the lifecycles a killed worker did not run, else ``None``."""
        if self.proc.returncode != -signal.SIGKILL or self.done() >= self.count:
            return None
        out = self.out.with_name(f"{self.out.stem}r.jsonl")
        return Worker(self.kind, self.count - self.done(), out, args, node, store, seed)


def run_phase(args, phase: int, rng: random.Random, node: SoakNode, store: Path,
              tmp: Path) -> dict:
    kinds = [k for k in KINDS if not (k == "lazy" and args.no_lazy)]
    per = max(1, args.lifecycles // max(1, args.workers))
    plan = [(kinds[i % len(kinds)], per) for i in range(args.workers)]
    if args.vms:
        plan.append(("vm", args.vms))
    workers = [Worker(kind, n, tmp / f"phase{phase}-w{i}.jsonl", args, node, store,
                      rng.getrandbits(32)) for i, (kind, n) in enumerate(plan)]
    cgroups_before = sandbox_cgroups()
    hostile = hostile_tenant(str(store), str(node.dir), rounds=2)
    faults: dict[str, int] = {}
    t0 = time.monotonic()
    while any(w.proc.poll() is None for w in workers):
        time.sleep(rng.uniform(0.5, 1.5))
        fault = rng.choice(FAULTS)
        if inject(fault, rng, node, store, [w.proc for w in workers]):
            faults[fault] = faults.get(fault, 0) + 1
        for w in list(workers):
            if w.proc.poll() is not None and (new := w.respawn(args, node, store,
                                                               rng.getrandbits(32))):
                workers.remove(w)
                workers.append(new)
                workers.append(w)   # kept for its records; it is done
                w.count = w.done()
    elapsed = time.monotonic() - t0
    hostile.kill()
    hostile.wait()
    settle(node.dir)
    records = [_record(line) for f in sorted(tmp.glob(f"phase{phase}-w*.jsonl"))
               for line in f.read_text().splitlines()]
    outcome = {r: sum(1 for x in records if x["result"] == r) for r in ("ok", "error", "wrong")}
    return {"phase": phase, "lifecycles": len(records), "seconds": round(elapsed, 1),
            "per_second": round(len(records) / elapsed, 2) if elapsed else 0.0, **outcome,
            "wrong_examples": [x for x in records if x["result"] == "wrong"][:3],
            "errors_by_kind": {k: sum(1 for x in records if x["kind"] == k and
                                      x["result"] == "error") for k in {*kinds, "vm"}},
            "top_errors": _top_errors(records),
            "faults": faults, "leaks": leaks(node.dir, cgroups_before)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", type=int, default=4)
    p.add_argument("--lifecycles", type=int, default=200, help="per phase")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--vms", type=int, default=2, help="microVM lifecycles per phase (0: none)")
    p.add_argument("--no-lazy", action="store_true")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--store", default=str(REPO / "cache"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", choices=(*KINDS, "vm"), help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    p.add_argument("--node", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.count, args.store, args.node, args.seed, args.out)
        return 0
    from _envs import ensure_built

    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="envbuild-soak-"))
    store = tmp / "store"
    ensure_built(Path(args.store), ENV.removeprefix("env/"))
    subprocess.run(["cp", "-a", args.store, str(store)], check=True)   # faults move it around
    node = SoakNode(tmp)
    print(f"soak: seed {seed}, host {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"{args.phases} phases of {args.lifecycles} lifecycles, {args.vms} microVMs each",
          flush=True)
    results = []
    try:
        for phase in range(args.phases):
            r = run_phase(args, phase, rng, node, store, tmp)
            results.append(r)
            if not args.json:
                print(f"phase {phase}: {r['lifecycles']} lifecycles in {r['seconds']} s "
                      f"({r['per_second']}/s): {r['ok']} ok, {r['error']} errors, "
                      f"{r['wrong']} wrong; faults {r['faults']}; leaks {r['leaks'] or 'none'}",
                      flush=True)
                for shape, count in r["top_errors"]:
                    print(f"  {count:5d} x {shape}", flush=True)
    finally:
        node.close()
    total = {"version": 1, "seed": seed, "phases": results,
             "lifecycles": sum(r["lifecycles"] for r in results),
             "wrong": sum(r["wrong"] for r in results),
             "leaks": sum(len(v) for r in results for v in r["leaks"].values()),
             "faults": sum(sum(r["faults"].values()) for r in results),
             "load_after": round(os.getloadavg()[0], 1)}
    seconds = sum(r["seconds"] for r in results)
    total["per_second"] = round(total["lifecycles"] / seconds, 2) if seconds else 0.0
    total["ok"] = sum(r["ok"] for r in results)
    total["ok_per_second"] = round(total["ok"] / seconds, 2) if seconds else 0.0
    if args.json:
        print(json.dumps(total))
    else:
        print(f"total: {total['lifecycles']} lifecycles, {total['per_second']}/s "
              f"({total['ok']} ok, {total['ok_per_second']}/s), "
              f"{total['faults']} faults injected, {total['wrong']} wrong, "
              f"{total['leaks']} leaks (goal 0 and 0); load after {total['load_after']}")
    subprocess.run(["rm", "-rf", "--one-file-system", str(tmp)], check=False)
    return 1 if total["wrong"] or total["leaks"] else 0


if __name__ == "__main__":
    sys.exit(main())
