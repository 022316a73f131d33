#!/usr/bin/env python3
"""pack-diff vs a full snapshot of the merged rootfs, measured in the same run.

    .venv/bin/python benchmarks/pack_diff.py [--env py-textstats] [--change-mb 10]

A sandbox of ENV (>= 300 MB uncompressed) changes about ``--change-mb`` MB — new files, edits to
existing files, deletions — then:

- **pack-diff**: ``Sandbox.pack_diff`` (pause, pack the upper dir under the hostile-content
  policy, store the layer, write the derived lock);
- **full snapshot** (what ``docker commit`` of a flattened image costs): pack the whole merged
  rootfs the sandbox sees into one layer with the same writer, and, as a second reference,
  GNU ``tar --sort=name … | zstd -3 -T2`` of the same tree.

Goal: pack-diff >= 20x faster and >= 20x smaller than the full snapshot.
Needs root, runc, and ENV built in the store (built first if missing).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _envs import ensure_built  # noqa: E402
from cold_start import lock_into, venv_layer  # noqa: E402

from envbuild.layers import pack_tree  # noqa: E402
from envbuild.plan.lockspec import LockLayer  # noqa: E402
from envbuild.store import LocalStore  # noqa: E402
from runtime_shim.node.locks import resolve  # noqa: E402
from runtime_shim.sdk.sandbox import Sandbox  # noqa: E402

CHANGE_SCRIPT = r"""
set -e
mkdir -p /workspace/generated
i=0
while [ $i -lt {files} ]; do
  head -c {file_bytes} /dev/urandom | base64 > /workspace/generated/f$i.txt
  i=$((i+1))
done
for f in $(find /usr/lib/python3.11 -name '*.py' | sort | head -n {edits}); do
  echo "# edited by the benchmark" >> "$f"
done
find /usr/share/doc -type f | sort | head -n {deletes} | xargs rm -f
rm -rf /usr/share/locale
"""


def tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=str(REPO / "cache"))
    ap.add_argument("--env", default="py-textstats",
                    help="env to start from; a virtualenv layer (numpy, pandas, django at "
                         "/opt/venv, made once by pip) is stacked on it to pass 300 MB")
    ap.add_argument("--change-mb", type=float, default=10.0)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (mounts, runc)", file=sys.stderr)
        return 1
    store_dir = Path(args.store)
    ensure_built(store_dir, args.env)
    store = LocalStore(store_dir)
    base = resolve(store, args.env)
    layers = [LockLayer(x.name, x.role, x.key, x.digest, x.diff_id, x.size, x.toc_digest)
              for x in base.layers] + [venv_layer(store)]
    big = f"{args.env}-venv-bench"
    lock_into(store, big, layers)
    work = Path(tempfile.mkdtemp(prefix="eb-packdiff-bench-"))
    random.seed(0)
    try:
        with Sandbox.create(big, store=store, node_dir=work / "node") as sb:
            # ~75 % of the change as new files (base64 of random bytes: realistic, poorly
            # compressible), the rest as edits and deletions
            files = 40
            file_bytes = int(args.change_mb * 0.75 * 1e6 / files / 1.35)
            script = CHANGE_SCRIPT.format(files=files, file_bytes=file_bytes, edits=300,
                                          deletes=200)
            r = sb.exec(script, timeout=300)
            assert r.exit_code == 0, r.stderr.decode()
            changed = tree_bytes(sb.paths.upper)
            merged_bytes = tree_bytes(sb.paths.merged)

            t = time.perf_counter()
            result = sb.pack_diff(None)
            t_diff = time.perf_counter() - t

            # the full snapshot: every byte of the merged rootfs, same writer, to a file
            full = work / "full.tar.zst"
            subprocess.run(["sync"], check=True)
            t = time.perf_counter()
            with open(full, "wb") as out:
                info = pack_tree(sb.paths.merged, out)
            t_full = time.perf_counter() - t
            gnu = work / "gnu.tar.zst"
            t = time.perf_counter()
            subprocess.run(f"tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner "
                           f"--format=posix -C {sb.paths.merged} -cf - . | zstd -q -3 -T2 -o {gnu}",
                           shell=True, check=True)
            t_gnu = time.perf_counter() - t
            gnu_size = gnu.stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nenv {args.env} + venv layer: merged rootfs {merged_bytes / 1e6:.0f} MB; "
          f"the sandbox changed {changed / 1e6:.1f} MB (upper dir)")
    print(f"{'':34} {'seconds':>8} {'MB':>9}")
    print(f"{'pack-diff (pause+pack+store+lock)':34} {t_diff:8.2f} {result.size / 1e6:9.2f}")
    print(f"{'full snapshot, envbuild writer':34} {t_full:8.2f} {info.size / 1e6:9.2f}")
    print(f"{'full snapshot, GNU tar | zstd -3':34} {t_gnu:8.2f} {gnu_size / 1e6:9.2f}")
    print(f"pack-diff is {t_full / t_diff:.1f}x faster and {info.size / result.size:.1f}x smaller "
          f"than the full snapshot (vs GNU tar|zstd: {t_gnu / t_diff:.1f}x, "
          f"{gnu_size / result.size:.1f}x); goal >= 20x and >= 20x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
