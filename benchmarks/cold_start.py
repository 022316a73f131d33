"""Cold start of a sandbox from S3 over a realistic link: lazy (files fetched on first open) vs
full pull + unpack, on an agent's workload, against the native-speed floor.

The env: ``py-minicalc`` (Debian bookworm + Python 3.11 bases, the minicalc workspace with its
pytest suite, the pytest toolkit; ``envbuild build py-minicalc busybox-shell`` makes it in the
local store ``--cache``) plus a virtualenv layer at ``/opt/venv`` with numpy, pandas and django
(the tree ``benchmarks/layer_pack.py`` makes, its interpreter links pointed at the base's
``/usr/bin/python3``): ~500 MB compressed.

The link (``benchmarks/shaped_link.py``): npm ``s3rver`` 3.7.1 runs in its own network
namespace behind a veth whose ends carry a token-bucket qdisc at the profile's rate, and a proxy
on 127.0.0.1 adds the profile's first-byte latency to every request. ``--link 1gbit:10ms`` is
one node's share of a busy cell, ``10gbit:2ms`` a quiet one, ``loopback`` the old flattering
setup. Bytes are counted on the wire (the host end of the veth), so every mode is measured the
same way, HTTP included.

The workload (``WORKLOAD``), each step timed: ``python3 -c 'print(1)'``, ``import numpy, pandas,
django``, the workspace's own ``pytest -q``, ``grep -r`` over the workspace. Per run, a fresh node
dir on tmpfs with the node's services up (the exec agent built and, for ``lazy``, the node's
filler started beforehand by a throwaway busybox sandbox, as on a fleet node: no mode pays for
them), timed from "nothing of the env on this node":

- ``full``: ``Sandbox.create(lock, store=S3Store)`` — each layer streamed over the link and
  unpacked into the node cache — then the workload;
- ``native``: then a second sandbox on that node, layers already unpacked: the floor;
- ``lazy``: ``Sandbox.create(..., lazy="native")`` (each layer a metadata tree the kernel serves
  over the node's object store, the placeholders filled on first open by the node's fanotify
  filler, docs/lazy-loading.md; the node's object store on the disk, ext4 here, bind-mounted
  into the tmpfs node dir: pre-content marks need a real filesystem), the node's first sight
  of the lock's layers (``native_layer_dirs``) timed apart as ``prepare``; its "lazy CPU" is
  the filler's (holder and worker, from its ping) until the sandbox closed, its ``fills`` the
  objects filled;
- ``lazy-rerun``: a second lazy sandbox on that node once the filler is idle (the wait is
  printed).

Then a burst: ``--burst`` lazy sandboxes of the lock started at once on one cold node, each
running the first two steps; bytes on the link against one sandbox's.

Goals (issue 36), at ``1gbit:10ms``: total <= 0.40x full's, first command >= 12x faster,
re-run (and a ``find /usr`` walk) <= 1.02x native, filler CPU <= 0.4 s a cold run, create -
the native floor's create <= 30 ms, bytes <= 13 % of the env (its unpacked size; the ratio to
the full pull's bytes is printed too), burst bytes <= 1.1x one sandbox's. Printed as
met/MISSED per link.

Usage::

    .venv/bin/python benchmarks/cold_start.py [--link 1gbit:10ms,10gbit:2ms] [--repeat 3]
        [--modes full,lazy] [--burst 20] [--cache ./cache] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _stats import host_speed, process_cpu  # noqa: E402
from layer_pack import SCRATCH, WORK, make_venv  # noqa: E402
from shaped_link import LinkProfile, ShapedLink  # noqa: E402

from envbuild.layers import LayerReader, pack_tree  # noqa: E402
from envbuild.oci import MEDIA_TYPE_CONFIG  # noqa: E402
from envbuild.plan.lockspec import LockLayer, RuntimeConfig, make_lock, merge_config  # noqa: E402
from envbuild.store import (  # noqa: E402
    PYIMPORT_RECORDS,
    LocalStore,
    copy_blobs,
    copy_layer_records,
    open_store,
    put_file,
    put_json,
)
from runtime_shim.isolation.mount import unmount  # noqa: E402
from runtime_shim.lazyfs.pyindex import index_layer_file  # noqa: E402
from runtime_shim.node.locks import resolve  # noqa: E402
from runtime_shim.node.nodecache import NodeCache  # noqa: E402
from runtime_shim.sdk.sandbox import Sandbox  # noqa: E402

COLD = WORK / "cold"
#: Where the object stores of ``lazy`` nodes live: on the disk, bind-mounted at the
#: node's ``objects/`` (the rest of the node dir on tmpfs, as every mode's): fanotify
#: pre-content marks need a filesystem that has them (tmpfs refuses them, EOPNOTSUPP), as a
#: real node's local ext4/xfs does. Removed at the end of the run, not between runs: a large
#: ``rm -rf`` on this VM's disk stalls the inode creation right after it.
NATIVE_OBJECTS = WORK / "native-objects"
MB = 1e6
#: What an agent does, in order: a first command, a heavy import, the workspace's own test
#: suite (workdir /workspace, the lock's PATH), then a search over the workspace.
WORKLOAD = (
    ("first", ["python3", "-c", "print(1)"]),
    ("import", ["/opt/venv/bin/python3", "-c", "import numpy, pandas, django"]),
    ("tests", ["pytest", "-q", "-p", "no:cacheprovider"]),
    ("grep", ["grep", "-r", "-c", "def", "/workspace"]),
)
STEPS = [name for name, _ in WORKLOAD]
#: A metadata walk (issue 36: "a metadata walk ``find /usr`` <= 1.02x native"), timed in each
#: sandbox but the cold lazy ones after the workload (the median of 3), outside its total:
#: every entry's stat.
WALK = ["sh", "-c", "find /usr -printf '%s %m\\n' >/dev/null"]


#: Bumped when the venv tree changes: an older tree and its packed blob are remade.
VENV_TREE_VERSION = "2: checked-hash .pyc"


def venv_layer(local: LocalStore) -> LockLayer:
    """numpy + pandas + django at /opt/venv, on the base's python3 (packed once).

    Its ``.pyc`` files are recompiled as *checked-hash* pycs, as an envbuild build makes them
    (a build step runs with ``SOURCE_DATE_EPOCH``, under which pip's ``py_compile`` writes
    checked-hash pycs): pip's timestamp pycs name the install's mtimes, which packing clamps,
    so every sandbox would find them stale and recompile numpy, pandas and django from source
    (measured: 1.45 s against 0.34 s for the import on this host), in every mode."""
    tree = COLD / "tree"
    blob = COLD / "venv.layer"
    done = tree / ".done"
    if not done.exists() or done.read_text() != VENV_TREE_VERSION:
        blob.unlink(missing_ok=True)
        src = make_venv(WORK / "venv-tree", ["numpy", "pandas", "django"])
        shutil.rmtree(tree, ignore_errors=True)
        (tree / "opt").mkdir(parents=True)
        subprocess.run(["cp", "-al", str(src), str(tree / "opt" / "venv")], check=True)
        venv = tree / "opt" / "venv"
        (venv / ".done").unlink(missing_ok=True)
        for name in ("python", "python3", "python3.11"):  # replace, never write through links
            (venv / "bin" / name).unlink(missing_ok=True)
        os.symlink("/usr/bin/python3", venv / "bin" / "python3")
        os.symlink("python3", venv / "bin" / "python")
        os.symlink("python3", venv / "bin" / "python3.11")
        (venv / "pyvenv.cfg").unlink()
        (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = "
                                         "false\nversion = 3.11\n")
        # compileall writes each pyc to a new file renamed into place: the hard links into
        # venv-tree (shared with layer_pack.py) keep their contents
        print("recompiling the venv's .pyc files as checked-hash pycs ...", flush=True)
        subprocess.run(["/usr/bin/python3", "-m", "compileall", "-q", "-f", "-j", "0",
                        "--invalidation-mode", "checked-hash", "-s", str(tree), "-p", "/",
                        str(venv / "lib")], check=True, stdout=subprocess.DEVNULL)
        done.write_text(VENV_TREE_VERSION)
    if not blob.exists():
        print("packing the venv layer ...", flush=True)
        with open(blob.with_suffix(".tmp"), "wb") as f:
            pack_tree(tree, f, source_date_epoch=0)
        blob.with_suffix(".tmp").rename(blob)
    info = put_file(local, blob)
    if local.get_record(PYIMPORT_RECORDS, info.digest[7:]) is None:
        index_layer_file(local, str(blob), info.digest)   # as a build does (pyindex)
    with LayerReader.open_file(blob) as r:
        return LockLayer(name="venv", role="toolkit", key="sha256:" + "0" * 64,
                         digest=info.digest, diff_id=r.toc.diff_id, size=info.size,
                         toc_digest=r.toc_digest)


def lock_into(store, name: str, layers: list[LockLayer], config: RuntimeConfig) -> str:
    lock = make_lock(name, layers, config)
    put_json(store, lock.config, media_type=MEDIA_TYPE_CONFIG)
    digest = put_json(store, lock.manifest).digest
    store.put_ref(f"env/{name}", digest)
    return digest


def rx_bytes(dev: str) -> int:
    """Bytes ``dev`` has received: with a shaped link, everything the store server sent."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == dev:
            return int(rest.split()[0])
    raise RuntimeError(f"no interface {dev} in /proc/net/dev")


#: The share of a core under which the filler counts as idle (``Bench.settle``): its timers
#: and the settle loop's own pings stay under it.
IDLE_CPU = 0.1


def filler_ping(node_dir: Path) -> dict:
    """The node's native filler's ping reply (``{}`` without an answer)."""
    from runtime_shim.lazyfs.native import filler_request

    return filler_request(str(node_dir / "node"), {"op": "ping"}, 5.0) or {}


def lazy_cpu(node_dir: Path) -> float:
    """CPU-seconds the node's filler has used: its holder's and worker's (a worker respawned
    since loses its predecessor's)."""
    reply = filler_ping(node_dir)
    return process_cpu(p for p in (reply.get("holder"), reply.get("pid"))
                       if isinstance(p, int) and p > 1)


def filler_fills(node_dir: Path) -> int:
    """Objects the native filler has filled (on open, and ahead: its ``fills`` count both;
    ``ahead`` is the part of them filled before an open)."""
    return int(filler_ping(node_dir).get("fills") or 0)


def filler_waits(log: Path) -> None:
    """Print what the native filler's log says of the fills readers waited for (one line per
    opened object: ``object X filled in S s``, from the event to the reader let on): how many,
    their sum and spread, the profile of a cold native run's reads."""
    waits = sorted(float(line.rsplit(" in ", 1)[1].split()[0])
                   for line in (log.read_text(errors="replace").splitlines()
                                if log.exists() else ()) if " filled in " in line)
    if waits:
        print(f"    filler: {len(waits)} opens waited for a fill, {sum(waits):.2f} s in all, "
              f"median {statistics.median(waits) * 1e3:.1f} ms, p90 "
              f"{waits[int(len(waits) * 0.9)] * 1e3:.1f} ms, max {waits[-1] * 1e3:.1f} ms",
              flush=True)


class Bench:
    """One link profile's run: the store behind the link, the env's lock, the meter."""

    def __init__(self, store, lock: str, warm_lock: str, link: ShapedLink, env_bytes: int):
        self.store, self.lock, self.warm_lock, self.link = store, lock, warm_lock, link
        self.env_bytes = env_bytes
        self.dev = link.host_if if link.profile.shaped else "lo"
        self.layers = resolve(store, lock).layers

    def fresh_node(self, tag: str, lazy: bool = False) -> Path:
        """An empty node dir on tmpfs whose node services are up, as on a node of a fleet:
        the exec agent built and (``lazy``) the node's filler started, by a throwaway busybox
        sandbox (so no mode pays for them). Nothing of the env is on the node."""
        node_dir = SCRATCH / f"cold-node-{os.getpid()}-{tag}"  # per run: others may run it too
        shutil.rmtree(node_dir, ignore_errors=True)
        if lazy:
            disk = NATIVE_OBJECTS / f"{os.getpid()}-{tag}"
            disk.mkdir(parents=True, mode=0o700)
            (node_dir / "node" / "objects").mkdir(parents=True, mode=0o700)
            subprocess.run(["mount", "--bind", str(disk), str(node_dir / "node" / "objects")],
                           check=True)
        try:
            with Sandbox.create(self.warm_lock, store=self.store, node_dir=node_dir,
                                lazy="native" if lazy else False) as sb:
                sb.exec(["true"])
        except BaseException:
            self.drop_node(node_dir)   # the node's filler with it
            raise
        return node_dir

    def drop_node(self, node_dir: Path) -> None:
        node = NodeCache(node_dir / "node")
        for log in (node_dir / "node" / "objects").glob("*.log"):   # the filler's
            for line in log.read_text(errors="replace").splitlines():
                if " ERROR " in line or " WARNING " in line or line.startswith("error"):
                    print(f"    {log.name[:12]}: {line}", flush=True)
        filler_waits(node_dir / "node" / "objects" / "filler.log")
        node.evict((), 0)  # the native layers unmounted; the filler stops
        unmount(str(node_dir / "node" / "objects"))   # a native node's object store, if any
        shutil.rmtree(node_dir, ignore_errors=True)

    def workload(self, sb, t0: float, steps: list[str] = STEPS) -> dict[str, float]:
        """Run the workload's ``steps`` in ``sb``: seconds per step; ``first`` is counted from
        ``t0`` (the create) as well as on its own (``first_cmd``)."""
        out: dict[str, float] = {}
        for name, argv in WORKLOAD:
            if name not in steps:
                continue
            t = time.perf_counter()
            r = sb.exec(argv, timeout=600)
            out[name if name != "first" else "first_cmd"] = time.perf_counter() - t
            if name == "first":
                out["first"] = time.perf_counter() - t0
            if r.exit_code != 0:
                raise RuntimeError(f"{name} exited {r.exit_code}: {r.stderr[-500:]!r}")
        out["workload"] = sum(out[k] for k in ("first_cmd", *steps[1:]) if k in out)
        return out

    def walk(self, sb) -> float:
        """Seconds of ``WALK`` in ``sb``: the median of 3."""
        times = []
        for _ in range(3):
            t = time.perf_counter()
            r = sb.exec(WALK, timeout=600)
            times.append(time.perf_counter() - t)
            if r.exit_code != 0:
                raise RuntimeError(f"walk exited {r.exit_code}: {r.stderr[-500:]!r}")
        return statistics.median(times)

    def timed(self, node_dir: Path, mode: str, *, lazy: bool = False,
              cold: bool = False) -> dict:
        """One sandbox of the lock on ``node_dir`` running the workload: the row of ``mode``
        (create, each step, total, bytes over the link while it ran, the CPU-seconds the
        store's processes used until the sandbox closed — s3rver and the latency proxy share
        the node's cores here, as a real store would not —; ``lazy``: also the filler's
        CPU-seconds until the close; ``cold`` and ``lazy``: the node's first sight of the
        layers apart (``prepare``), the objects filled and the read path)."""
        rx0 = rx_bytes(self.dev)
        store0 = process_cpu(self.link.pids)
        prepare = prepare_cpu = None
        if cold and lazy:   # the node's first sight, its filler's CPU apart
            cpu0 = lazy_cpu(node_dir)
            prepare = self.prepare(node_dir)
            prepare_cpu = lazy_cpu(node_dir) - cpu0
        daemon0 = lazy_cpu(node_dir) if lazy else 0.0
        fills0 = filler_fills(node_dir) if lazy else 0
        t0 = time.perf_counter()
        with Sandbox.create(self.lock, store=self.store, node_dir=node_dir,
                            lazy="native" if lazy else False) as sb:
            row = {"mode": mode, "create": time.perf_counter() - t0, **self.workload(sb, t0)}
            if prepare is not None:
                row["prepare"], row["prepare_cpu"] = prepare, prepare_cpu
            row["bytes"] = rx_bytes(self.dev) - rx0
            if not cold:   # a cold row's lazy CPU stays the workload's own
                row["walk"] = self.walk(sb)
            if cold and lazy:
                row["fills"] = filler_fills(node_dir) - fills0
                row["transport"] = sb.info().lazy
        row["total"] = row.get("prepare", 0.0) + row["create"] + row["workload"]
        row["store_cpu"] = process_cpu(self.link.pids) - store0
        if lazy:
            row["daemon_cpu"] = lazy_cpu(node_dir) - daemon0
        return row

    def prepare(self, node_dir: Path) -> float:
        """Seconds of the node's first sight of the lock's layers, ahead of the native
        create (as a fleet node pulling the lock would): each layer's TOC, metadata tree,
        placeholders and marks, mounted (``native_layer_dirs``). A cold row's ``create`` is
        then the create on a node that knows the layers; its total counts both."""
        from runtime_shim.lazyfs.native import native_layer_dirs

        t = time.perf_counter()
        native_layer_dirs(str(node_dir / "node"), self.store, self.layers)
        return time.perf_counter() - t

    def run_full(self, run: int) -> list[dict]:
        """Full pull + unpack over the link, then the workload; then, on the same node with the
        layers now unpacked, the same workload again: the native floor."""
        node_dir = self.fresh_node(f"full-{run}")
        try:
            return [self.timed(node_dir, "full"), self.timed(node_dir, "native")]
        finally:
            self.drop_node(node_dir)

    def run_lazy(self, run: int) -> list[dict]:
        """A lazy sandbox on a cold node, then a second one on the same node once everything
        the workload touched is on the node (``-rerun``)."""
        node_dir = self.fresh_node(f"lazy-{run}", lazy=True)
        try:
            cold = self.timed(node_dir, "lazy", lazy=True, cold=True)
            settle = self.settle(node_dir)
            rerun = self.timed(node_dir, "lazy-rerun", lazy=True)
            rerun["settle"] = settle
            return [cold, rerun]
        finally:
            self.drop_node(node_dir)

    def settle(self, node_dir: Path, window: float = 0.25, limit: float = 15.0) -> float:
        """Wait until the node's filler has finished what the cold run left it (the
        predictions' last fills): under ``IDLE_CPU`` of a core over a ``window``, at most
        ``limit`` s. The re-run's goal is "once all touched files are fetched"; the seconds
        waited are reported."""
        t0 = time.perf_counter()
        last = lazy_cpu(node_dir)
        while time.perf_counter() - t0 < limit:
            time.sleep(window)
            now = lazy_cpu(node_dir)
            if now - last < IDLE_CPU * window:
                break
            last = now
        return time.perf_counter() - t0

    def run_burst(self, n: int) -> dict:
        """``n`` lazy sandboxes of the lock started at once on one cold node, each running the
        first command and the heavy import; bytes over the link against one sandbox's."""
        steps = ["first", "import"]

        def one(node_dir: Path) -> None:
            t0 = time.perf_counter()
            with Sandbox.create(self.lock, store=self.store, node_dir=node_dir,
                                lazy="native") as sb:
                self.workload(sb, t0, steps)

        node_dir = self.fresh_node("burst-single", lazy=True)
        try:
            rx0 = rx_bytes(self.dev)
            one(node_dir)
            single = rx_bytes(self.dev) - rx0
        finally:
            self.drop_node(node_dir)
        node_dir = self.fresh_node("burst", lazy=True)
        try:
            rx0 = rx_bytes(self.dev)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                for f in [pool.submit(one, node_dir) for _ in range(n)]:
                    f.result()
            seconds = time.perf_counter() - t0
            burst = rx_bytes(self.dev) - rx0
            fills = filler_fills(node_dir)
        finally:
            self.drop_node(node_dir)
        return {"n": n, "single_bytes": single, "burst_bytes": burst, "seconds": seconds,
                "fills": fills}


def start_store(link: ShapedLink, cache: LocalStore, digests: list[str]):
    """s3rver inside the link's namespace, the env's blobs pushed through the link."""
    from lazy_read import S3RVER_VERSION, S3rver

    server = S3rver()  # installs s3rver once; we run it ourselves, in the namespace
    server.data = SCRATCH / f"s3rver-cold-{os.getpid()}"  # not the shared default: other
    shutil.rmtree(server.data, ignore_errors=True)        # benchmarks wipe that one
    server.data.mkdir(parents=True)
    exe = WORK / "s3rver" / "node_modules" / ".bin" / "s3rver"
    if not exe.exists():
        server.start()
        server.kill()
    assert exe.exists(), f"s3rver {S3RVER_VERSION} did not install"
    link.run_server(["node", str(exe), "-d", str(server.data), "-a", link.server_ip,
                     "-p", str(server.port), "--silent"], server.port,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = link.endpoint(server.port)
    os.environ.update({"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    import boto3

    boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(Bucket="cold")
    store = open_store("s3://cold/envs", s3_endpoint=endpoint)
    print("  pushing the env through the link ...", flush=True)
    copy_blobs(cache, store, digests)
    copy_layer_records(cache, store, digests)   # the layers' import indexes
    return store, server.data


def med(rows: list[dict], mode: str, key: str) -> float:
    values = [r[key] for r in rows if r["mode"] == mode and key in r]
    return statistics.median(values) if values else float("nan")


def report(profile: LinkProfile, rows: list[dict], burst: dict | None, env_bytes: int,
           repeat: int) -> dict:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    print(f"\nlink {profile}; median of {repeat} runs")
    cols = ["create", "first", "import", "tests", "grep", "total"]
    print(f"{'mode':<20}" + "".join(f"{c + ' s':>9}" for c in cols)
          + f"{'MB on link':>12}{'store CPU':>10}{'lazy CPU':>10}{'fills':>10}")

    def has(mode: str, key: str) -> bool:
        return any(key in r for r in rows if r["mode"] == mode)

    for mode in modes:
        print(f"{mode:<20}" + "".join(f"{med(rows, mode, c):>9.2f}" for c in cols)
              + f"{med(rows, mode, 'bytes') / MB:>12.1f}"
              + "".join(f"{med(rows, mode, k):>10.2f}" if has(mode, k) else f"{'':>10}"
                        for k in ("store_cpu", "daemon_cpu"))
              + (f"{med(rows, mode, 'fills'):>10.0f}" if has(mode, "fills") else ""))
    goals: dict[str, tuple[float, str, bool]] = {}
    if "full" in modes and "lazy" in modes:
        compressed = med(rows, "lazy", "bytes") / med(rows, "full", "bytes")
        goals["bytes on the link / full pull's (reported)"] = (compressed, "-", True)
    if "lazy-rerun" in modes:
        print(f"lazy-rerun: started {med(rows, 'lazy-rerun', 'settle'):.2f} s after the cold "
              f"sandbox closed, the filler idle (median)")
    goals.update(native_goals(rows, modes, env_bytes))
    if burst:
        ratio = burst["burst_bytes"] / max(burst["single_bytes"], 1)
        print(f"burst: {burst['n']} lazy sandboxes at once on one cold node: "
              f"{burst['burst_bytes'] / MB:.1f} MB on the link vs {burst['single_bytes'] / MB:.1f}"
              f" MB for one, {burst['fills']} objects filled, {burst['seconds']:.1f} s to all done")
        goals[f"burst of {burst['n']}: bytes vs one sandbox"] = (ratio, "<= 1.1x", ratio <= 1.1)
    print("goals:")
    for name, (value, goal, ok) in goals.items():
        print(f"  {name:<40} {value:>7.2f}  goal {goal:<13} {'met' if ok else 'MISSED'}")
    return {"link": profile.text, "rows": rows, "burst": burst,
            "goals": {k: {"value": v, "goal": g, "met": ok} for k, (v, g, ok) in goals.items()}}


def native_goals(rows: list[dict], modes: list[str],
                 env_bytes: int) -> dict[str, tuple[float, str, bool]]:
    """Issue 36's table for ``lazy``, from the same run's ``full`` and ``native`` rows. "lazy create - full
    create": a cold lazy create (nothing of the env on the node, its services up) minus a
    create of the env already unpacked there (the ``native`` row); "rerun create": the same
    for a lazy create whose layers this node already holds."""
    goals: dict[str, tuple[float, str, bool]] = {}
    if "full" not in modes or "native" not in modes:
        return goals
    for mode in ("lazy",):
        if mode not in modes:
            continue
        tag = f"[{mode}] "
        total = med(rows, mode, "total") / med(rows, "full", "total")
        goals[tag + "total workload vs full"] = (total, "<= 0.40x", total <= 0.40)
        first = med(rows, "full", "first") / med(rows, mode, "first")
        goals[tag + "first command, full / lazy"] = (first, ">= 12x", first >= 12)
        if mode + "-rerun" in modes:
            rerun = med(rows, mode + "-rerun", "workload") / med(rows, "native", "workload")
            goals[tag + "re-run vs native"] = (rerun, "<= 1.02x", rerun <= 1.02)
            walk = med(rows, mode + "-rerun", "walk") / med(rows, "native", "walk")
            goals[tag + "re-run find /usr vs native"] = (walk, "<= 1.02x", walk <= 1.02)
            warm = med(rows, mode + "-rerun", "create") - med(rows, "native", "create")
            goals[tag + "rerun create - native create, s"] = (warm, "(reported)", True)
        cpu = med(rows, mode, "daemon_cpu")
        goals[tag + "filler CPU-s, cold run"] = (cpu, "<= 0.4 s", cpu <= 0.4)
        extra = med(rows, mode, "create") - med(rows, "native", "create")
        goals[tag + "cold create - native create, s"] = (extra, "<= 0.030 s", extra <= 0.030)
        if any("prepare" in r for r in rows if r["mode"] == mode):
            prep = med(rows, mode, "prepare")
            goals[tag + "node's first sight of the lock, s"] = (prep, "(reported)", True)
            cpu = med(rows, mode, "prepare_cpu")
            goals[tag + "filler CPU-s of the first sight"] = (cpu, "(reported)", True)
            first = med(rows, "full", "first") / (prep + med(rows, mode, "first"))
            goals[tag + "first cmd incl. first sight, full/lazy"] = (first, "(reported)", True)
        share = med(rows, mode, "bytes") / env_bytes
        goals[tag + "bytes on the link / env"] = (share, "<= 0.13", share <= 0.13)
    return goals


def bench_env(cache: LocalStore, where: Path,
              tool: str) -> tuple[list[LockLayer], list[LockLayer], RuntimeConfig]:
    """The benchmark's env from the store ``cache`` (at ``where``): the cold lock's layers
    (py-minicalc's and the venv's), the warm lock's (busybox-shell's) and the cold lock's
    config. Exits with the build command when they are not built (``tool``: who says so)."""
    try:
        minicalc = resolve(cache, "py-minicalc")
        busybox = resolve(cache, "busybox-shell").layers
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"{tool}: {e}; build them first: envbuild --store {where} "
                         "build py-minicalc busybox-shell") from None

    def as_lock(x) -> LockLayer:
        return LockLayer(name=x.name, role=x.role, key=x.key or "sha256:" + "0" * 64,
                         digest=x.digest, diff_id=x.diff_id, size=x.size,
                         toc_digest=x.toc_digest)

    layers = [as_lock(x) for x in minicalc.layers] + [venv_layer(cache)]
    config = RuntimeConfig(env=dict(minicalc.env), workdir=minicalc.workdir,
                           user=minicalc.user, cmd=minicalc.cmd)
    return layers, [as_lock(x) for x in busybox], config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--link", default="1gbit:10ms,10gbit:2ms",
                    help="comma-separated RATE:LATENCY profiles, or loopback")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="full,lazy")
    ap.add_argument("--burst", type=int, default=20, help="sandboxes in the burst (0: none)")
    ap.add_argument("--cache", type=Path, default=REPO / "cache",
                    help="local store with env/py-minicalc and env/busybox-shell built")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    profiles = [LinkProfile.parse(t) for t in args.link.split(",")]

    COLD.mkdir(parents=True, exist_ok=True)
    cache = LocalStore(args.cache)
    layers, warm, config = bench_env(cache, args.cache, "cold_start")
    unpacked = 0
    for x in layers:
        with LayerReader.open_file(cache.blob_path(x.digest)) as r:
            unpacked += r.toc.tar_size
    # The env's size is its unpacked size (the "506 MB env"); the full pull's bytes on
    # the link (the compressed blobs) are printed beside it.
    env_bytes = unpacked
    host = host_speed()
    print(f"host: {host}", flush=True)
    print(f"env: py-minicalc + a numpy/pandas/django venv: {len(layers)} layers, "
          f"{sum(x.size for x in layers) / MB:.0f} MB compressed, {unpacked / MB:.0f} MB of tar",
          flush=True)
    print("workload: " + "; ".join(f"{n}: {' '.join(a)}" for n, a in WORKLOAD), flush=True)

    results = []
    for profile in profiles:
        print(f"\n== link {profile}", flush=True)
        with ShapedLink(profile) as link:
            store, data = start_store(link, cache, [x.digest for x in layers + warm])
            try:
                lock = lock_into(store, "cold", layers, config)
                warm_lock = lock_into(store, "warm", warm, merge_config([RuntimeConfig()]))
                bench = Bench(store, lock, warm_lock, link, env_bytes)
                rows: list[dict] = []
                for run in range(args.repeat):
                    for mode in args.modes.split(","):
                        if mode == "full":
                            got = bench.run_full(run)
                        elif mode == "lazy":
                            got = bench.run_lazy(run)
                        else:
                            raise SystemExit(f"cold_start: unknown mode {mode!r}")
                        for row in got:
                            print(f"  run {run} {row['mode']:<18} "
                                  + (f"first sight {row['prepare']:.2f} s (filler CPU "
                                     f"{row['prepare_cpu']:.2f} s), " if "prepare" in row
                                     else "") + f"create {row['create']:.2f} s, "
                                  f"first exits {row['first']:.2f} s, workload "
                                  f"{row['workload']:.2f} s, total {row['total']:.2f} s, "
                                  f"{row['bytes'] / MB:.1f} MB on the link"
                                  + (f", {row['fills']} objects filled" if "fills" in row
                                     else "")
                                  + (f", reads: {row['transport']}" if row.get("transport")
                                     else "")
                                  + f"; CPU-s: store {row['store_cpu']:.2f}"
                                  + (f", filler {row['daemon_cpu']:.2f}"
                                     if "daemon_cpu" in row else "")
                                  + (f" (after {row['settle']:.2f} s for the filler to go idle)"
                                     if "settle" in row else ""), flush=True)
                        rows.extend(got)
                burst = bench.run_burst(args.burst) if args.burst else None
                results.append(report(profile, rows, burst, env_bytes, args.repeat))
            finally:
                shutil.rmtree(data, ignore_errors=True)
                for disk in NATIVE_OBJECTS.glob(f"{os.getpid()}-*"):   # the native nodes'
                    shutil.rmtree(disk, ignore_errors=True)
    if args.json:
        # version 2: an object with the host line (version 1 was the bare list of links)
        args.json.write_text(json.dumps({"version": 2, "host": host, "links": results},
                                        indent=2))


if __name__ == "__main__":
    main()
