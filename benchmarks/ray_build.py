"""Distributed builds on Ray against the local executor, measured in the same run (issue 15).

Starts its own moto S3 server and a local Ray cluster (``tests/ray_cluster.py``: a head plus
two worker nodes offering ``envbuild_builder: 2`` each), generates a busybox base and N
workspaces on it, then, all through the real CLI in fresh processes:

1. **throughput**: N workspaces whose one step is ``sleep S`` plus a small write (waiting
   dominates, so the 2-core host is not the bottleneck): ``envbuild build --jobs 2`` into a
   local store vs ``envbuild build --executor ray`` (2 nodes x 2 slots) into S3.
   Goal: Ray >= 1.8x the local throughput.
2. **per-task overhead**: N no-op workspaces (a source copy, no step), the same two ways;
   (Ray time - local time) / N. Goal: <= 50 ms per layer.
3. **no duplicate work**: two concurrent ``--executor ray`` builds of N fresh workspaces into
   one S3 prefix; every key must be ``built`` by exactly one of them (``cached`` in the other).

The base is built beforehand in each store (and the Ray workers warmed up by that build), so
the timings are of the workspaces only.

Usage::

    .venv/bin/python benchmarks/ray_build.py                 # N=200, sleep 0.5
    .venv/bin/python benchmarks/ray_build.py --layers 50 --sleep 0.5
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

    def ray(self, defs: Path, url: str, *names: str) -> tuple[float, dict]:
        return self._run(self.ray_argv(*names), self.ray_env(defs, url))

    @staticmethod
    def _run(args: list[str], env: dict[str, str]) -> tuple[float, dict]:
        start = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "envbuild.cli", *args], env=env,
                           capture_output=True, text=True, timeout=3600)
        took = time.monotonic() - start
        if p.returncode != 0:
            sys.exit(f"build failed ({p.returncode}):\n{p.stderr[-3000:]}")
        return took, json.loads(p.stdout)


def built(report: dict) -> int:
    return sum(o["status"] == "built" for o in report["layers"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--sleep", type=float, default=0.5)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--s3-baseline", action="store_true",
                    help="also time the local executor into S3 (separates store cost from Ray's)")
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
              f"load {os.getloadavg()[0]:.2f}", flush=True)

        results = {}
        for phase, sleep in (("sleep", args.sleep), ("noop", None)):
            defs = write_tree(root, phase, n, sleep)
            store, url = root / f"store-{phase}", f"s3://{bucket}/{phase}"
            run.local(defs, store, "busybox-tiny")
            run.ray(defs, url, "busybox-tiny")  # also starts the nodes' workers
            t_local, rep_local = run.local(defs, store)
            t_ray, rep_ray = run.ray(defs, url)
            assert built(rep_local) == built(rep_ray) == n, (built(rep_local), built(rep_ray))
            nodes = {o["node"] for o in rep_ray["layers"] if o["status"] == "built"}
            results[phase] = (t_local, t_ray)
            print(f"{phase:>5}: local --jobs 2 {t_local:7.1f} s ({n / t_local:5.1f} layers/s)   "
                  f"ray 2x2 {t_ray:7.1f} s ({n / t_ray:5.1f} layers/s) on {len(nodes)} nodes",
                  flush=True)
            if args.s3_baseline:  # the local executor into the same kind of store (moto S3)
                s3 = f"s3://{bucket}/{phase}-local"
                run._run(["build", "--json", "busybox-tiny"],
                         run.env(defs, s3, str(root / "local-node")))
                t_s3, rep = run._run(["build", "--jobs", "2", "--json"],
                                     run.env(defs, s3, str(root / "local-node")))
                assert built(rep) == n
                print(f"{phase:>5}: local --jobs 2 into S3 {t_s3:7.1f} s "
                      f"({n / t_s3:5.1f} layers/s)", flush=True)

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
        print(f"load at the end {os.getloadavg()[0]:.2f}")
    finally:
        cluster.cluster.shutdown()
        moto.kill()
        if not args.keep:
            for node in list(root.glob("ray-node-*")) + [root / "local-node"]:
                subprocess.run([sys.executable, "-c",
                                "import sys; from runtime_shim.layout import NodeLayout;"
                                "from runtime_shim.runc import OciRuntime;"
                                "from envbuild.build.executor import sweep_stale_scratch;"
                                "l = NodeLayout(sys.argv[1]);"
                                "sweep_stale_scratch(l.builds, OciRuntime('runc', "
                                "state_root=str(l.runc)))", str(node)],
                               env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
