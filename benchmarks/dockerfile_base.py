"""What does a Dockerfile base cost over the ``docker build`` it drives?

Same Dockerfile, same context, same run, each repeat from nothing (no BuildKit cache):

- **baseline**: a fresh private dockerd (``envbuild.dockerd.docker_daemon``), then
  ``DOCKER_BUILDKIT=1 docker build`` + ``docker save`` (what any tool must do to get the
  layers out of the daemon), then the daemon stopped and removed — timed from start to end;
- **envbuild**: ``envbuild build BASE`` in a fresh process with an empty store: planning
  (context digest), the same daemon start, build and save, the import through the safe
  unpacker, packing the envbuild layer and storing it, the daemon stopped and removed.

Prints both times per repeat and the ratio envbuild / baseline (best of ``--repeat``). The
context: a static busybox plus ``--files`` small files (a COPY of the whole context), a
multi-stage Dockerfile with two RUN steps under ``--network=none``.

Usage::

    .venv/bin/python benchmarks/dockerfile_base.py               # 2,000 files, 2 repeats
    .venv/bin/python benchmarks/dockerfile_base.py --files 20000 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DOCKERFILE = """\
FROM scratch AS tools
COPY busybox /bin/busybox
SHELL ["/bin/busybox", "sh", "-c"]
RUN /bin/busybox --install -s /bin && mkdir -p /etc /tmp

FROM tools
COPY . /ctx/
RUN find /ctx -type f | wc -l > /etc/count
"""


def make_context(root: Path, files: int) -> Path:
    ctx = root / "envdefs" / "base" / "ctx"
    ctx.mkdir(parents=True)
    shutil.copy2("/bin/busybox", ctx / "busybox")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    for i in range(files):
        d = ctx / "src" / f"d{i // 100:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:05d}.py").write_text(f"# file {i}\nVALUE = {i}\n" * 4)
    (root / "envdefs" / "base" / "bench.yaml").write_text(
        "apiVersion: envbuild/v1\nkind: Base\nname: bench\nabi: bench-1\n"
        "from:\n  dockerfile: {context: ctx, network: none}\n")
    return ctx


def baseline(ctx: Path, scratch: Path) -> float:
    from envbuild.dockerd import docker_daemon

    started = time.perf_counter()
    with docker_daemon(scratch / "d") as d:
        env = d.env()
        iid = scratch / "iid"
        subprocess.run([d.cli, "build", "-q", "--network=none", "--iidfile", str(iid), str(ctx)],
                       env=env, check=True, capture_output=True, timeout=600)
        subprocess.run([d.cli, "save", "-o", str(scratch / "img.tar"), iid.read_text().strip()],
                       env=env, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - started


def with_envbuild(root: Path, run: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    env.update(ENVBUILD_DEFS=str(root / "envdefs"), ENVBUILD_STORE=str(root / f"store{run}"),
               ENVBUILD_NODE_CACHE=str(root / f"node{run}"), PYTHONPATH=str(REPO))
    started = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "envbuild.cli", "build", "bench"], env=env,
                       capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - started
    if p.returncode != 0:
        raise SystemExit(f"envbuild build failed:\n{p.stderr}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="envbuild-bench-dockerfile-"))
    try:
        ctx = make_context(root, args.files)
        base_times, eb_times = [], []
        for i in range(args.repeat):
            b = baseline(ctx, root / f"base{i}")
            e = with_envbuild(root, i)
            base_times.append(b)
            eb_times.append(e)
            print(f"repeat {i + 1}: docker build+save {b:6.2f} s   envbuild build {e:6.2f} s   "
                  f"ratio {e / b:4.2f}")
        print(f"best: docker build+save {min(base_times):.2f} s, envbuild build "
              f"{min(eb_times):.2f} s, ratio {min(eb_times) / min(base_times):.2f} "
              f"({args.files} files, load {os.getloadavg()[0]:.1f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
