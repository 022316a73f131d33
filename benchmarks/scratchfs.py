#!/usr/bin/env python3
"""Disk-limit mechanisms compared (docs/scratchfs.md): per (size, inodes), the median of
``--runs`` set-up + tear-down cycles of

1. ``mkfs.ext4`` per sandbox + loop device + mount + unmount;
2. a copy of a pre-formatted sparse template (``runtime_shim.isolation.scratchfs.create`` / ``destroy``),
   with and without waiting for the loop device's detach (``destroy`` leaves it to a thread);
3. the sparse copy alone, in-process (``SEEK_DATA`` + ``copy_file_range``) and ``cp --sparse=always``;
4. a tmpfs with ``size=`` and ``nr_inodes=``;
5. a subvolume of a btrfs pool with its capped quota group, and its deletion
   (``runtime_shim.isolation.quotafs``, docs/disk-pool.md).

    .venv/bin/python benchmarks/scratchfs.py [--dir DIR] [--runs 20]

Needs root (loop devices, mounts). ``--dir`` must be on the host filesystem to measure (default:
a temporary dir under the repo).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from envbuild.libc import LIBC  # noqa: E402
from runtime_shim.isolation import quotafs, scratchfs  # noqa: E402
from runtime_shim.isolation.mount import unmount  # noqa: E402

SHAPES = ((64 << 20, 1000), (10 << 30, 1_000_000), (50 << 30, 5_000_000))


def median_ms(base: Path, fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        d = Path(tempfile.mkdtemp(dir=base))
        t = time.perf_counter()
        fn(d)
        times.append(time.perf_counter() - t)
        shutil.rmtree(d)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (loop devices, mounts)", file=sys.stderr)
        return 1
    base = Path(tempfile.mkdtemp(prefix=".scratchfs-bench-", dir=args.dir or REPO))
    pool = base / "pool-mnt"
    try:
        pool.mkdir()
        quotafs.format_image(base / "pool.img", 64 << 30)
        quotafs.mount_image(base / "pool.img", pool)
        for size, inodes in SHAPES:
            t = time.perf_counter()
            template = scratchfs.ensure_template(base / "templates", size, inodes)
            made = (time.perf_counter() - t) * 1e3
            data_kib = os.stat(template).st_blocks // 2

            def per_sandbox_mkfs(d: Path) -> None:
                (d / "disk").mkdir()
                scratchfs.mkfs(d / "disk.img", size, inodes)
                fd = scratchfs._mount_image(d / "disk.img", d / "disk")
                unmount(str(d / "disk"))
                os.close(fd)  # the loop device detaches here
                os.unlink(d / "disk.img")

            def from_template(d: Path) -> None:
                scratchfs.create(d, size, inodes, template_root=base / "templates")
                scratchfs.destroy(d)
                scratchfs.settle()

            def from_template_async(d: Path) -> None:
                scratchfs.create(d, size, inodes, template_root=base / "templates")
                scratchfs.destroy(d)

            def pool_subvolume(d: Path) -> None:
                quotafs.create(pool, d.name, size)
                quotafs.destroy(pool / d.name)

            def copy_only(d: Path) -> None:
                scratchfs.copy_sparse(template, d / "x.img")

            def cp_only(d: Path) -> None:
                subprocess.run(["cp", "--sparse=always", str(template), str(d / "x.img")],
                               check=True)

            print(f"{size >> 20} MiB, {inodes} inodes: template made in {made:.1f} ms, "
                  f"{data_kib} KiB of data")
            for name, fn in (("mkfs per sandbox + loop + mount + umount", per_sandbox_mkfs),
                             ("template copy + loop + mount + umount + detach", from_template),
                             ("  the same, detach left to destroy's thread", from_template_async),
                             ("  sparse copy alone (in-process)", copy_only),
                             ("  sparse copy alone (cp --sparse=always)", cp_only),
                             ("pool: subvolume + capped quota group + delete", pool_subvolume)):
                print(f"  {name:48} {median_ms(base, fn, args.runs):7.2f} ms")

        def tmpfs(d: Path) -> None:
            if LIBC.mount(b"tmpfs", str(d).encode(), b"tmpfs", 0x406,
                           b"size=64m,nr_inodes=1000,mode=0755") != 0:
                raise OSError(ctypes.get_errno(), "mount tmpfs")
            unmount(str(d))

        print(f"tmpfs size=64m,nr_inodes=1000 mount + umount {median_ms(base, tmpfs, args.runs):7.2f} ms")
    finally:
        scratchfs.settle()
        unmount(str(pool), lazy_fallback=False)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
