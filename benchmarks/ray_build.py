"""Distributed builds on Ray against the local executor, measured in the same run (issue 15).

Starts its own moto S3 server and a local Ray cluster (``tests/ray_cluster.py``: a head plus
two worker nodes offering ``envbuild_builder: 2`` each), generates a busybox base and N
workspaces on it, then, all through the real CLI in fresh processes:

1. **throughput**: N workspaces whose one step is ``sleep S`` plus a small write (waiting
   dominates, so the 2-core host is not the bottleneck): ``envbuild build --jobs 2`` vs
   ``envbuild build --executor ray`` (2 nodes x 2 slots), both into the same S3 (moto; the
   same store, the same lease and record round trips: the baseline is fair).
   Goal: Ray >= 1.8x the local throughput.
2. **per-task overhead**: N no-op workspaces (a source copy, no step), the same two ways;
   (Ray time - local time) / N. Goal: <= 50 ms per layer. ``--local-store`` also times the
   local executor into a local store (what S3 itself costs).
3. **no duplicate work**: two concurrent ``--executor ray`` builds of N fresh workspaces into
   one S3 prefix; every key must be ``built`` by exactly one of them (``cached`` in the other).

The base is built beforehand in each store, so the timings are of the workspaces only (each
Ray build still starts its own worker processes: a build is a Ray job).

``--trace`` has every Ray task append its phase times (``ENVBUILD_RAY_TRACE``) and prints
where a task's time goes beyond its step, and how many steps ran at once (from the nodes' own
timestamps).

Usage::

    .venv/bin/python benchmarks/ray_build.py                 # the issue's shape: N=200, sleep 0.5
    .venv/bin/python benchmarks/ray_build.py --layers 100 --sleep 2 --trace
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.ray_cluster import start_cluster  # noqa: E402  (sets Ray's loopback env first)
from tests.store.s3server import CREDENTIALS, MotoServer  # noqa: E402

GOAL_SPEEDUP = 1.8
GOAL_OVERHEAD_MS = 50.0
FORWARD = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
           "AWS_EC2_METADATA_DISABLED", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


def write_tree(root: Path, prefix: str, count: int, sleep: float | None) -> Path:
    """busybox-tiny (from envdefs/) plus ``count`` workspaces; ``sleep`` None: no step."""
    defs = root / f"defs-{prefix}" / "envdefs"
    for rel in ("base/busybox-tiny.yaml", "base/files/busybox"):
        target = defs / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        src = REPO / "envdefs" / rel
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, target)
    (defs / "workspaces").mkdir()
    sources = defs.parent / "sources"
    for i in range(count):
        name = f"{prefix}{i:04d}"
        (sources / name).mkdir(parents=True)
        (sources / name / "id").write_text(name)
        step = ("" if sleep is None else
                f"steps:\n  - run: sleep {sleep} && cp /workspace/id /workspace/built\n"
                "    network: none\n")
        (defs / "workspaces" / f"{name}.yaml").write_text(
            f"apiVersion: envbuild/v1\nkind: Workspace\nname: {name}\nbuild_on: busybox-tiny\n"
            f"source: {{path: ../../sources/{name}}}\ndest: /workspace\n{step}")
    return defs


class Runner:
    def __init__(self, root: Path, moto: MotoServer, address: str) -> None:
        self.root, self.moto, self.address = root, moto, address

    def env(self, defs: Path, store: str, node: str) -> dict[str, str]:
        env = {**os.environ, **CREDENTIALS, "PYTHONPATH": str(REPO), "ENVBUILD_DEFS": str(defs),
               "ENVBUILD_STORE": store, "ENVBUILD_S3_ENDPOINT": self.moto.endpoint,
               "ENVBUILD_NODE_CACHE": node, "RAY_ADDRESS": self.address}
        env.pop("AWS_ENDPOINT_URL", None)
        return env

    def local(self, defs: Path, store: Path, *names: str) -> tuple[float, dict]:
        return self._run(["build", "--jobs", "2", "--json", *names],
                         self.env(defs, str(store), str(self.root / "local-node")))

    def ray_argv(self, *names: str) -> list[str]:
        fwd = [a for n in FORWARD for a in ("--ray-env", n)]
        return ["build", "--executor", "ray", "--ray-address", self.address, *fwd, "--json",
                *names]

    def ray_env(self, defs: Path, url: str) -> dict[str, str]:
        return self.env(defs, url, str(self.root / "ray-node-{node_id}"))

    def ray(self, defs: Path, url: str, *names: str, trace: Path | None = None
            ) -> tuple[float, dict]:
        env = self.ray_env(defs, url)
        argv = self.ray_argv(*names)
        if trace is not None:
            env["ENVBUILD_RAY_TRACE"] = str(trace)
            argv = [argv[0], "--ray-env", "ENVBUILD_RAY_TRACE", *argv[1:]]
        return self._run(argv, env)

    #: wall clock (unix time) of the last run's start and end, for the trace's spans
    last_run: tuple[float, float] = (0.0, 0.0)

    @classmethod
    def _run(cls, args: list[str], env: dict[str, str]) -> tuple[float, dict]:
        wall = time.time()
        start = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "envbuild.cli", *args], env=env,
                           capture_output=True, text=True, timeout=3600)
        took = time.monotonic() - start
        cls.last_run = (wall, time.time())
        if p.returncode != 0:
            sys.exit(f"build failed ({p.returncode}):\n{p.stderr[-3000:]}")
        return took, json.loads(p.stdout)


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _spans(tasks: list[dict], start: str, end: str) -> list[tuple[float, float]]:
    out = []
    for t in tasks:
        marks = dict(t["marks"])
        if start in marks and end in marks:
            out.append((marks[start], marks[end]))
    return out


def concurrency(spans: list[tuple[float, float]]) -> tuple[int, float]:
    """(most at once, time-weighted mean at once over the first start .. last end)."""
    if not spans:
        return 0, 0.0
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    now = most = 0
    area, last = 0.0, edges[0][0]
    for t, d in edges:
        area += now * (t - last)
        last = t
        now += d
        most = max(most, now)
    return most, area / (edges[-1][0] - edges[0][0] or 1)


def print_trace(path: Path, phase: str, run: tuple[float, float]) -> None:
    """Median time of each of a Ray task's phases (its node's clock), and step concurrency."""
    import statistics

    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    tasks = [t for t in lines if t["status"] == "built"]
    for d in (t for t in lines if t["status"] == "driver"):
        print(f"{phase:>5}: driver, s after its start: " + ", ".join(
            f"{m} {t - run[0]:.1f}" for m, t in d["marks"]), flush=True)
    if not tasks:
        return
    order = ["task", "started", "importing", "step", "packing", "ended"]
    parts = []
    for a, b in zip(order, order[1:]):
        d = [y - x for x, y in _spans(tasks, a, b)]
        if d:
            parts.append(f"{a}->{b} {statistics.median(d) * 1000:.0f}")
    print(f"{phase:>5}: ray task phases, median ms: " + ", ".join(parts), flush=True)
    work = _spans(tasks, "step", "packing") or _spans(tasks, "importing", "packing")
    most, mean = concurrency(work)
    whole = _spans(tasks, "task", "ended")
    most_t, mean_t = concurrency(whole)
    first = min(a for a, _ in whole)
    last = max(b for _, b in whole)
    print(f"{phase:>5}: driver start -> first task {first - run[0]:.1f} s, tasks "
          f"{last - first:.1f} s, last task end -> driver exit {run[1] - last:.1f} s", flush=True)
    pids = {(t["node"], t["pid"]) for t in tasks}
    print(f"{phase:>5}: steps at once: max {most}, mean {mean:.2f}; tasks at once: max {most_t}, "
          f"mean {mean_t:.2f}; {len(pids)} worker processes on "
          f"{len({n for n, _ in pids})} nodes", flush=True)


def built(report: dict) -> int:
    return sum(o["status"] == "built" for o in report["layers"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--sleep", type=float, default=0.5)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--local-store", action="store_true",
                    help="also time the local executor into a local store (what S3 costs)")
    ap.add_argument("--trace", action="store_true",
                    help="print where Ray tasks spend their time and how many steps ran at once")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (overlay mounts, runc)")
    root = Path(tempfile.mkdtemp(prefix="ray-build-bench-"))
    moto = MotoServer().start()
    cluster = start_cluster()
    try:
        bucket = moto.make_bucket()
        run = Runner(root, moto, cluster.address)
        n = args.layers
        print(f"Ray cluster: head + 2 nodes x envbuild_builder 2; {n} layers; "
              f"load {load()}", flush=True)

        results = {}
        for phase, sleep in (("sleep", args.sleep), ("noop", None)):
            defs = write_tree(root, phase, n, sleep)
            url, s3 = f"s3://{bucket}/{phase}", f"s3://{bucket}/{phase}-local"
            local_node = str(root / "local-node")
            run._run(["build", "--json", "busybox-tiny"], run.env(defs, s3, local_node))
            run.ray(defs, url, "busybox-tiny")
            trace = root / f"trace-{phase}.jsonl" if args.trace else None
            t_local, rep_local = run._run(["build", "--jobs", "2", "--json"],
                                          run.env(defs, s3, local_node))
            t_ray, rep_ray = run.ray(defs, url, trace=trace)
            assert built(rep_local) == built(rep_ray) == n, (built(rep_local), built(rep_ray))
            nodes = {o["node"] for o in rep_ray["layers"] if o["status"] == "built"}
            results[phase] = (t_local, t_ray)
            print(f"{phase:>5}: local --jobs 2 {t_local:7.1f} s ({n / t_local:5.1f} layers/s)   "
                  f"ray 2x2 {t_ray:7.1f} s ({n / t_ray:5.1f} layers/s) on {len(nodes)} nodes, "
                  f"both into S3; load {load()}", flush=True)
            if trace is not None:
                print_trace(trace, phase, Runner.last_run)
            if args.local_store:  # the local executor into a local store: what S3 costs
                store = root / f"store-{phase}"
                run.local(defs, store, "busybox-tiny")
                t_ls, rep = run.local(defs, store)
                assert built(rep) == n
                print(f"{phase:>5}: local --jobs 2 into a local store {t_ls:7.1f} s "
                      f"({n / t_ls:5.1f} layers/s)", flush=True)

        t_local, t_ray = results["sleep"]
        speedup = t_local / t_ray
        print(f"throughput: ray / local = {speedup:.2f}x (goal >= {GOAL_SPEEDUP}x): "
              f"{'ok' if speedup >= GOAL_SPEEDUP else 'MISSED'}")
        t_local, t_ray = results["noop"]
        overhead = (t_ray - t_local) / n * 1000
        print(f"per-task overhead: ({t_ray:.1f} - {t_local:.1f}) s / {n} = {overhead:.1f} ms/layer "
              f"(goal <= {GOAL_OVERHEAD_MS:.0f}): "
              f"{'ok' if overhead <= GOAL_OVERHEAD_MS else 'MISSED'}")

        defs = write_tree(root, "twice", n, args.sleep)
        url = f"s3://{bucket}/twice"
        run.ray(defs, url, "busybox-tiny")
        argv = [sys.executable, "-m", "envbuild.cli", *run.ray_argv()]
        start = time.monotonic()
        procs = [subprocess.Popen(argv, env=run.ray_env(defs, url), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=3600) for p in procs]
        took = time.monotonic() - start
        for p, (_, err) in zip(procs, outs, strict=True):
            if p.returncode != 0:
                sys.exit(f"concurrent build failed:\n{err[-3000:]}")
        reports = [{o["name"]: o["status"] for o in json.loads(out)["layers"]} for out, _ in outs]
        once = sum(sorted((reports[0][k], reports[1][k])) == ["built", "cached"]
                   for k in reports[0] if k != "busybox-tiny")
        print(f"two concurrent ray builds of {n} layers in {took:.1f} s: {once}/{n} keys built "
              f"exactly once ({built({'layers': [{'status': s} for s in reports[0].values()]})} "
              f"+ {built({'layers': [{'status': s} for s in reports[1].values()]})} builds): "
              f"{'ok' if once == n else 'MISSED'}")
        print(f"load at the end {load()}")
    finally:
        cluster.cluster.shutdown()
        moto.kill()
        if not args.keep:
            for node in list(root.glob("ray-node-*")) + [root / "local-node"]:
                subprocess.run([sys.executable, "-c",
                                "import sys; from runtime_shim.node.layout import NodeLayout;"
                                "from runtime_shim.isolation.runc import OciRuntime;"
                                "from envbuild.build.executor import sweep_stale_scratch;"
                                "l = NodeLayout(sys.argv[1]);"
                                "sweep_stale_scratch(l.builds, OciRuntime('runc', "
                                "state_root=str(l.runc)))", str(node)],
                               env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
