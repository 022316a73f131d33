"""Client CPU and wall time per ranged GET through the one keep-alive client
(``envbuild.store._http.RangeClient``), as the lazy filler (``HttpRanges``, a presigned URL) and
``S3Store.get_range`` use it, against moto on loopback; baseline: boto3's ``get_object`` with a
``Range`` for the same reads.

moto spends ~1.5 ms of server CPU per request, so the wall time is mostly the server's; the
client CPU (``getrusage`` of this process; moto is another) is what the client costs.

Usage::

    .venv/bin/python benchmarks/range_client.py [--gets 1000] [--size 4096]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from envbuild.store import digest_bytes  # noqa: E402
from envbuild.store.lazy import HttpRanges  # noqa: E402
from envbuild.store.s3 import S3Store  # noqa: E402
from tests.store.s3server import MotoServer, session  # noqa: E402


class _Boto:
    """The baseline: one boto3 ranged ``get_object`` per read."""

    def __init__(self, store: S3Store) -> None:
        self.store = store

    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        resp = self.store.client.get_object(Bucket=self.store.bucket,
                                            Key=self.store._blob_key(digest),
                                            Range=f"bytes={offset}-{offset + length - 1}")
        return resp["Body"].read()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gets", type=int, default=1000)
    ap.add_argument("--size", type=int, default=4096)
    args = ap.parse_args()
    server = MotoServer().start()
    try:
        store = S3Store(server.make_bucket("bench"), "p", endpoint_url=server.endpoint,
                        session=session())
        data = os.urandom(1 << 20)
        digest = digest_bytes(data)
        store.put(digest, data)
        readers = {"HttpRanges (lazy filler)": HttpRanges(digest, store.presigned_get_url(digest),
                                                          lambda: store),
                   "S3Store.get_range": store, "boto3 get_object (baseline)": _Boto(store)}
        for name, reader in readers.items():
            reader.get_range(digest, 0, args.size)  # connect, sign
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for i in range(args.gets):
                off = (i * 7919 * 4096) % (len(data) - args.size)
                assert reader.get_range(digest, off, args.size) == data[off:off + args.size]
            r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
            print(f"  {name:<28} client CPU {cpu * 1000 / args.gets:.3f} ms/GET   "
                  f"wall {(t1 - t0) * 1000 / args.gets:.2f} ms/GET")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
