"""Layer format v1: pack / unpack speed, size overhead and lazy single-file reads vs GNU tar+zstd.

Goals (the layer-format issue), each a ratio against a baseline measured in the same run:

- pack (``pack_tree``) vs ``tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner
  --format=posix -cf - DIR | zstd -3 -T2``: <= 1.0
- full unpack (``LayerReader.unpack``) vs ``tar --zstd -xf``: <= 1.5
- compressed size vs one zstd -3 stream of the same tar: <= +3 % (compact), <= +20 % (lazy)
- one ~100 KB file from a ~200 MB layer: decompressed bytes <= 4 MiB + TOC, time < 20 ms

Trees (made once into benchmarks/.work/, gitignored): a virtualenv with numpy, pandas and django
(pip from PyPI) and a copy of /usr/lib/x86_64-linux-gnu. ``--quick`` uses a django-only
virtualenv and the first ~150 MB of the /usr/lib copy.

Usage::

    .venv/bin/python benchmarks/layer_pack.py [--quick] [--repeat 3] [--trees venv,usrlib]
        [--wait-idle 0.9 --idle-timeout 60]     # on a shared machine
    .venv/bin/python benchmarks/layer_pack.py --profile pack|unpack --trees venv
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from envbuild.layers import LayerReader, pack_tree  # noqa: E402

WORK = REPO / "benchmarks" / ".work"
# outputs and unpack destinations live on tmpfs: on this VM's disk, inode creation right after a
# large rm -rf stalls for seconds (GNU tar and we alike), which would measure the disk, not us
SCRATCH = Path("/dev/shm/envbuild-layer-bench") if Path("/dev/shm").is_dir() else WORK / "scratch"
TAR_FLAGS = ["--sort=name", "--mtime=@0", "--owner=0", "--group=0", "--numeric-owner",
             "--format=posix"]


def sh(cmd: str) -> None:
    subprocess.run(["bash", "-o", "pipefail", "-c", cmd], check=True)


def make_venv(path: Path, packages: list[str]) -> Path:
    if not (path / ".done").exists():
        shutil.rmtree(path, ignore_errors=True)
        print(f"making {path.name}: pip install {' '.join(packages)} ...", flush=True)
        subprocess.run(["python3", "-m", "venv", str(path)], check=True)
        subprocess.run([str(path / "bin" / "pip"), "install", "-q", *packages], check=True)
        (path / ".done").write_text("")
    return path


def make_usrlib(path: Path, limit: int | None) -> Path:
    if not (path / ".done").exists():
        shutil.rmtree(path, ignore_errors=True)
        print(f"copying /usr/lib/x86_64-linux-gnu to {path} ...", flush=True)
        if limit is None:
            sh(f"cp -a /usr/lib/x86_64-linux-gnu {path}")
        else:
            total = 0
            src = Path("/usr/lib/x86_64-linux-gnu")
            for dirpath, dirnames, filenames in os.walk(src):
                dirnames.sort()
                rel = Path(dirpath).relative_to(src)
                (path / rel).mkdir(parents=True, exist_ok=True)
                for n in sorted(filenames):
                    s = Path(dirpath) / n
                    if total > limit:
                        break
                    if s.is_symlink():
                        os.symlink(os.readlink(s), path / rel / n)
                    elif s.is_file():
                        shutil.copy2(s, path / rel / n)
                        total += s.stat().st_size
        (path / ".done").write_text("")
    return path


def tree_stats(root: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames:
            st = os.lstat(os.path.join(dirpath, n))
            files += 1
            size += st.st_size
        files += len(dirnames)
    return files, size


def warm(root: Path) -> None:
    sh(f"tar -cf - -C {root} . > /dev/null")


def timed(fn, repeat: int, before=None) -> float:
    times = []
    for _ in range(repeat):
        if before:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _cpu_idle(seconds: float) -> float:
    """Share of all CPUs idle over the next ``seconds`` (from /proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)
    i0, t0 = sample()
    time.sleep(seconds)
    i1, t1 = sample()
    return (i1 - i0) / max(1, t1 - t0)


IDLE_WAIT = {"threshold": 0.0, "timeout": 0.0}  # set by --wait-idle


def wait_idle() -> None:
    """With --wait-idle, start a round only once the machine is mostly idle (other engineers'
    jobs share it), or after the timeout."""
    if IDLE_WAIT["threshold"] <= 0:
        return
    deadline = time.monotonic() + IDLE_WAIT["timeout"]
    while _cpu_idle(0.5) < IDLE_WAIT["threshold"] and time.monotonic() < deadline:
        pass


def paired(fns: dict, repeat: int) -> dict[str, list[tuple[float, float]]]:
    """Run every function once per round, ``repeat`` rounds: {name: [(wall, cpu), ...]} with
    cpu = user + sys of this process and its children during the call."""
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(repeat):
        wait_idle()
        for k, fn in fns.items():
            r0, c0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
                resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            fn()
            w = time.perf_counter() - t
            r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
                resource.RUSAGE_CHILDREN)
            cpu = sum(getattr(b, f) - getattr(a, f) for a, b in ((r0, r1), (c0, c1))
                      for f in ("ru_utime", "ru_stime"))
            out[k].append((w, cpu))
    return out


def spread(runs: list[tuple[float, float]]) -> str:
    walls = [w for w, _ in runs]
    return (f"wall {min(walls):.2f}-{max(walls):.2f} s, "
            f"CPU {statistics.median(c for _, c in runs):.2f} s")


def clean(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def bench_tree(name: str, root: Path, repeat: int) -> list[tuple[str, str, str]]:
    out = SCRATCH / "out"
    out.mkdir(parents=True, exist_ok=True)
    warm(root)
    files, size = tree_stats(root)
    print(f"\n== {name}: {root} ({files} entries, {size / 1e6:.0f} MB)", flush=True)
    rows: list[tuple[str, str, str]] = []
    base = out / f"{name}.gnu.tar.zst"
    lazy, compact = out / f"{name}.lazy", out / f"{name}.compact"

    def gnu():
        sh(f"tar {' '.join(TAR_FLAGS)} -C {root} -cf - . | zstd -q -3 -T2 > {base}")

    def pack(path: Path, framing: str):
        with open(path, "wb") as f:
            return pack_tree(root, f, framing=framing)

    # interleaved: gnu, lazy, compact, gnu, ... so that load from other processes on this shared
    # machine hits both sides alike; the ratio is the median of per-round ratios
    runs = paired({"gnu": gnu, "lazy": lambda: pack(lazy, "lazy"),
                   "compact": lambda: pack(compact, "compact")}, repeat)
    t_gnu = statistics.median(w for w, _ in runs["gnu"])
    rows.append(("pack: gnu tar | zstd -3 -T2", f"{t_gnu:.2f} s",
                 f"1.00 (baseline; {spread(runs['gnu'])})"))
    for fr in ("lazy", "compact"):
        ratios = [w / g for (w, _), (g, _) in zip(runs[fr], runs["gnu"])]
        cpu = [c / gc for (_, c), (_, gc) in zip(runs[fr], runs["gnu"])]
        rows.append((f"pack: pack_tree {fr}", f"{statistics.median(w for w, _ in runs[fr]):.2f} s",
                     f"{statistics.median(ratios):.2f}  goal <= 1.0 (per-round ratios "
                     f"{min(ratios):.2f}-{max(ratios):.2f}; {spread(runs[fr])}; CPU ratio "
                     f"{statistics.median(cpu):.2f})"))

    # sizes: our own tar (identical in both framings) as one zstd -3 stream
    single = out / f"{name}.single.zst"
    sh(f"zstd -q -dc {compact} | zstd -q -3 -T2 > {single}")
    s_single = single.stat().st_size
    with LayerReader.open_file(lazy) as r:
        toc_lazy = r.footer.toc_csize + 8 + 80
    with LayerReader.open_file(compact) as r:
        toc_compact = r.footer.toc_csize + 8 + 80
    s_lazy, s_compact = lazy.stat().st_size, compact.stat().st_size
    rows.append(("size: one zstd -3 stream of the tar", f"{s_single / 1e6:.1f} MB",
                 "1.000 (baseline)"))
    rows.append(("size: gnu tar | zstd -3 -T2", f"{base.stat().st_size / 1e6:.1f} MB",
                 f"{base.stat().st_size / s_single:.3f}"))
    rows.append(("size: lazy layer (incl. TOC)", f"{s_lazy / 1e6:.1f} MB",
                 f"{s_lazy / s_single:.3f}  goal <= 1.20 (TOC {toc_lazy / 1e3:.0f} KB, "
                 f"frames alone {(s_lazy - toc_lazy) / s_single:.3f})"))
    rows.append(("size: compact layer (incl. TOC)", f"{s_compact / 1e6:.1f} MB",
                 f"{s_compact / s_single:.3f}  goal <= 1.03 (TOC {toc_compact / 1e3:.0f} KB, "
                 f"frames alone {(s_compact - toc_compact) / s_single:.3f})"))

    dest = SCRATCH / "unpacked"
    def untar():
        clean(dest)
        t = time.perf_counter()
        sh(f"mkdir -p {dest} && tar --zstd -xf {base} -C {dest}")
        return time.perf_counter() - t

    def unpack(path: Path):
        clean(dest)  # not timed
        t = time.perf_counter()
        with LayerReader.open_file(path) as r:
            r.unpack(dest)
        return time.perf_counter() - t

    # interleaved like pack; the wall time excludes removing the previous tree
    un: dict[str, list[float]] = {"gnu": [], "lazy": [], "compact": []}
    for _ in range(repeat):
        wait_idle()
        un["gnu"].append(untar())
        un["lazy"].append(unpack(lazy))
        un["compact"].append(unpack(compact))
    clean(dest)
    t_untar = statistics.median(un["gnu"])
    rows.append(("unpack: tar --zstd -xf", f"{t_untar:.2f} s",
                 f"1.00 (baseline; wall {min(un['gnu']):.2f}-{max(un['gnu']):.2f} s)"))
    for fr in ("lazy", "compact"):
        ratios = [a / g for a, g in zip(un[fr], un["gnu"])]
        rows.append((f"unpack: LayerReader.unpack {fr}", f"{statistics.median(un[fr]):.2f} s",
                     f"{statistics.median(ratios):.2f}  goal <= 1.5 (per-round ratios "
                     f"{min(ratios):.2f}-{max(ratios):.2f})"))

    # lazy single-file reads: the file closest to 100 KB, then a random 5 % of the files
    r = LayerReader.open_file(lazy)
    regular = [e for e in r.entries() if e.type == "file" and e.size]
    target = min(regular, key=lambda e: abs(e.size - 100_000))
    opens, reads, both = [], [], []
    for _ in range(max(9, repeat)):
        t = time.perf_counter()
        with LayerReader.open_file(lazy) as rr:
            t_open = time.perf_counter() - t
            rr.read(target.path)
            both.append(time.perf_counter() - t)
        opens.append(t_open)
        reads.append(both[-1] - t_open)
    with LayerReader.open_file(lazy) as rr:
        rr.read(target.path)
        decompressed = rr.stats.bytes_decompressed
    toc_u = r.footer.toc_usize
    rows.append((f"lazy read: open (footer + TOC, {len(r.entries())} entries)",
                 f"{statistics.median(opens) * 1e3:.1f} ms",
                 f"TOC {r.footer.toc_csize / 1e3:.0f} KB compressed, {toc_u / 1e6:.1f} MB JSON "
                 f"(min {min(opens) * 1e3:.1f}, max {max(opens) * 1e3:.1f} ms)"))
    rows.append((f"lazy read: one {target.size / 1e3:.0f} KB file",
                 f"{statistics.median(reads) * 1e3:.2f} ms",
                 f"decompressed {decompressed / 1e3:.0f} KB (goal <= 4 MiB + TOC)"))
    rows.append(("lazy read: open + that file", f"{statistics.median(both) * 1e3:.1f} ms",
                 f"goal < 20 ms (min {min(both) * 1e3:.1f}, max {max(both) * 1e3:.1f} ms)"))
    random.seed(5)
    sample = random.sample(regular, max(1, len(regular) // 20))
    r.close()

    def touched_share(path: Path, size: int) -> float:
        # distinct frames a reader with a frame cache would fetch, over the blob size
        with LayerReader.open_file(path) as rr:
            frames = {(c.offset, c.csize) for e in sample for c in rr.stat(e.path).chunks}
        return sum(c for _, c in frames) / size

    touched, touched_c = touched_share(lazy, s_lazy), touched_share(compact, s_compact)
    rows.append(("lazy read: random 5 % of files, distinct frames",
                 f"{touched * 100:.1f} % (lazy)", f"{touched_c * 100:.1f} % (compact)"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller trees")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--trees", default="venv,usrlib")
    ap.add_argument("--profile", choices=["pack", "unpack"], help="cProfile one operation")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SHARE",
                    help="before each pack round, wait (up to --idle-timeout s) until this share "
                         "of the CPUs was idle over 0.5 s, e.g. 0.9 on a shared machine")
    ap.add_argument("--idle-timeout", type=float, default=60.0)
    args = ap.parse_args()
    IDLE_WAIT.update(threshold=args.wait_idle, timeout=args.idle_timeout)
    WORK.mkdir(parents=True, exist_ok=True)
    trees = {}
    for t in args.trees.split(","):
        if t == "venv":
            trees[t] = (make_venv(WORK / "venv-quick", ["django"]) if args.quick else
                        make_venv(WORK / "venv-tree", ["numpy", "pandas", "django"]))
        elif t == "usrlib":
            trees[t] = make_usrlib(WORK / ("usrlib-quick" if args.quick else "usrlib"),
                                   150_000_000 if args.quick else None)
        else:
            ap.error(f"unknown tree {t!r}")
    if args.profile:
        name, root = next(iter(trees.items()))
        layer = SCRATCH / "out" / f"{name}.profile"
        layer.parent.mkdir(parents=True, exist_ok=True)
        warm(root)
        prof = cProfile.Profile()
        if args.profile == "pack":
            with open(layer, "wb") as f:
                prof.runcall(pack_tree, root, f)
        else:
            with open(layer, "wb") as f:
                pack_tree(root, f)
            dest = SCRATCH / "unpacked"
            clean(dest)
            with LayerReader.open_file(layer) as r:
                prof.runcall(r.unpack, dest)
            clean(dest)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, repeat {args.repeat} "
          f"(medians), load average {os.getloadavg()[0]:.1f} at start")
    try:
        for name, root in trees.items():
            report(bench_tree(name, root, args.repeat))
            print(f"(load average {os.getloadavg()[0]:.1f} after {name})")
    finally:
        shutil.rmtree(SCRATCH, ignore_errors=True)


def report(rows) -> None:
    w = max(len(r[0]) for r in rows)
    print(f"{'measure':<{w}}  {'absolute':>12}  ratio")
    for label, absolute, ratio in rows:
        print(f"{label:<{w}}  {absolute:>12}  {ratio}")


if __name__ == "__main__":
    main()
