"""Lazy daemon settings compared on cold nodes, taking turns: the baseline and each variant in
the same run, over ``cold_start``'s shaped link, env and workload.

The lazy path's totals move by ±10 % from run to run on a 2-core host (the host's own speed
drifts within minutes), so a setting is judged only against the baseline measured beside it.
Each round runs every setting once, each on a fresh node with its own daemon (which reads the
setting's environment at start), and every other round runs them in reverse order, so a host
that speeds up or slows down does not favour the settings that come first. Printed per
setting: medians (and the mean total) of the create, each workload step, the total, the
daemon's CPU seconds (its ping), MB on the link and store requests, and its median total as a
ratio of the baseline's (the first setting).

Usage::

    .venv/bin/python benchmarks/lazy_settings.py [--link 1gbit:10ms] [--rounds 5]
        [--cache ./cache] base: nohedge:ENVBUILD_LAZY_HEDGE_MS=0 ...

Each setting is ``NAME:VAR=VALUE,VAR=VALUE`` (``NAME:`` alone: the defaults). The env is
built once into ``--cache`` (``envbuild --store CACHE build py-minicalc busybox-shell``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import cold_start as cs  # noqa: E402

from envbuild.store import LocalStore  # noqa: E402

STEPS = ("create", "first_cmd", "import", "tests", "grep", "total", "cpu", "bytes", "requests")


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:VAR=VALUE,...`` -> ``(NAME, {VAR: VALUE})``; only ``ENVBUILD_*`` variables (the
    daemon's settings), so a typo cannot change the harness itself."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"lazy_settings: {text!r} is not NAME:VAR=VALUE,... (NAME: alone for "
                         "the defaults)")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var.startswith("ENVBUILD_"):
            raise SystemExit(f"lazy_settings: {item!r} in {text!r} is not ENVBUILD_VAR=VALUE")
        env[var] = value
    return name, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("settings", nargs="+", help="NAME:VAR=VALUE,... (the first: the baseline)")
    ap.add_argument("--link", default="1gbit:10ms", help="RATE:LATENCY, or loopback")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache", type=Path, default=REPO / "cache",
                    help="local store with env/py-minicalc and env/busybox-shell built")
    args = ap.parse_args()
    settings = [parse_setting(s) for s in args.settings]
    if len({name for name, _ in settings}) != len(settings):
        raise SystemExit("lazy_settings: two settings have the same name")

    cs.COLD.mkdir(parents=True, exist_ok=True)
    cache = LocalStore(args.cache)
    layers, warm, config = cs.bench_env(cache, args.cache, "lazy_settings")
    profile = cs.LinkProfile.parse(args.link)
    print(f"link {profile}; {args.rounds} rounds of {len(settings)} settings, taking turns",
          flush=True)
    rows: dict[str, list[dict]] = {name: [] for name, _ in settings}
    base_env = dict(os.environ)
    with cs.ShapedLink(profile) as link:
        store, data = cs.start_store(link, cache, [x.digest for x in layers + warm])
        try:
            lock = cs.lock_into(store, "cold", layers, config)
            warm_lock = cs.lock_into(store, "warm", warm, cs.merge_config([cs.RuntimeConfig()]))
            bench = cs.Bench(store, lock, warm_lock, link, 1)
            for r in range(args.rounds):
                for name, env in (settings if r % 2 == 0 else settings[::-1]):
                    os.environ.clear()
                    os.environ.update({**base_env, **env})
                    try:
                        cs.drop_profiles(store)
                        node_dir = bench.fresh_node(f"settings-{r}-{name}")
                        row = bench.timed(node_dir, name, lazy="fuse", cold=True)
                        row["cpu"] = cs.daemon_cpu(node_dir)   # since the daemon started
                        cs.NodeCache(node_dir / "node").evict((), 0)
                        shutil.rmtree(node_dir, ignore_errors=True)
                    finally:
                        os.environ.clear()
                        os.environ.update(base_env)
                    rows[name].append(row)
                    print(f"  round {r} {name:<12} " + " ".join(
                        f"{k} {row[k] / cs.MB:.1f}MB" if k == "bytes" else
                        f"{k} {row[k]}" if k == "requests" else f"{k} {row[k]:.2f}"
                        for k in STEPS if k in row), flush=True)
        finally:
            shutil.rmtree(data, ignore_errors=True)

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in rows[name] if key in x)

    baseline = settings[0][0]
    print(f"\nmedians of {args.rounds} cold runs each (total's mean in brackets); "
          f"ratio: total / {baseline}'s")
    for name, _ in settings:
        mean = statistics.mean(x["total"] for x in rows[name])
        print(f"{name:<12} create {med(name, 'create'):.3f} import {med(name, 'import'):.3f} "
              f"tests {med(name, 'tests'):.3f} total {med(name, 'total'):.3f} ({mean:.3f}) "
              f"cpu {med(name, 'cpu'):.3f} MB {med(name, 'bytes') / cs.MB:.1f} "
              f"requests {med(name, 'requests'):.0f} "
              f"ratio {med(name, 'total') / med(baseline, 'total'):.3f}")


if __name__ == "__main__":
    main()
