"""The node daemon's lazy profiles: a first run's reads recorded and saved, a later run's prefetched.

The reads of a stack's first lazy run are recorded per mount and saved to the store once
``PROFILE_WINDOW`` is over (``runtime_shim.lazyfs.profile``); a later run's profile is
prefetched (the ``prefetch`` request)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from envbuild.errors import EnvbuildError
from runtime_shim.lazyfs.frames import prefetch_in_order
from runtime_shim.lazyfs.profile import PROFILE_NAMESPACE, PROFILE_VERSION, PROFILE_WINDOW, _Trace

log = logging.getLogger("envbuild.lazyfs")


class _Profiles:
    """The node daemon's part (a mixin of ``_NodeDaemon``) that records and prefetches lazy
    profiles. Uses the daemon's ``lock``, its mounts (``ops``), ``profiles`` (key ->
    ``{"req", "traces", "saved", "until"}``) and ``_store``."""

    lock: threading.Lock
    ops: dict[str, Any]
    profiles: dict[str, dict[str, Any]]
    _store: Callable[[str, str | None], Any]

    def _start_prefetch(self, req: dict[str, Any]) -> dict[str, Any]:
        started = 0
        key = req.get("key")
        if isinstance(key, str):
            with self.lock:   # the stack has a profile: its mounts' reads need no saving
                rec = self.profiles.get(key)
                if rec is not None:
                    rec["saved"] = True
        for item in req.get("layers", ()):
            with self.lock:
                ops = self.ops.get(item["mountpoint"])
            if ops is not None and item.get("paths"):
                threading.Thread(target=self._prefetch,
                                 args=(ops, item["paths"], ops.lazy_layer.digest),
                                 name="prefetch", daemon=True).start()
                started += 1
        return {"ok": True, "started": started}

    def _prefetch(self, ops: Any, paths: Sequence[str], digest: str) -> None:
        import time

        t0 = time.monotonic()
        try:
            n = prefetch_in_order(ops.lazy_frames, ops.lazy_nodes, paths)
        except EnvbuildError as e:  # a foreground read will report it
            log.warning("prefetch of %s: %s", digest, e)
            return
        log.info("prefetched %d of %d profiled files of %s in %.2f s", n, len(paths), digest,
                 time.monotonic() - t0)

    def _trace(self, prof: dict[str, Any], digest: str) -> _Trace:
        import time

        with self.lock:
            rec = self.profiles.get(prof["key"])
            if rec is None:
                rec = self.profiles[prof["key"]] = {
                    "req": prof, "traces": {}, "saved": False,
                    "until": time.monotonic() + PROFILE_WINDOW}
                timer = threading.Timer(PROFILE_WINDOW, self._save_profile, (prof["key"],))
                timer.daemon = True
                timer.start()
            trace = rec["traces"][digest] = _Trace(rec["until"])
        return trace

    def _save_profile(self, key: str) -> None:
        with self.lock:
            rec = self.profiles.get(key)
            if rec is None or rec["saved"]:
                return
            rec["saved"] = True
        prof, traces = rec["req"], rec["traces"]
        with self.lock:
            layers = [{"digest": d, "files": list(traces[d].paths)}
                      for d in prof["layers"] if d in traces]
        if not any(x["files"] for x in layers):
            return
        record = {"version": PROFILE_VERSION, "layers": layers}
        files = sum(len(x["files"]) for x in layers)
        put_url = prof.get("put_url")
        if isinstance(put_url, str) and put_url and _put_presigned(key, put_url, record, files):
            return
        try:
            store = self._store(prof["store"], prof.get("s3_endpoint"))
            store.put_record(PROFILE_NAMESPACE, key, record)
        except Exception as e:  # noqa: BLE001 - a hint only; never take a mount down for it
            log.warning("save lazy profile %s: %s", key, e)
            return
        log.info("saved lazy profile %s (%d files)", key, files)


def _put_presigned(key: str, put_url: str, record: dict[str, Any], files: int) -> bool:
    """Save the profile ``record`` through a presigned PUT (``Presigner``): no store client in
    this process (boto3's would hold the GIL for ~0.4 s while every FUSE request of the node
    waits). True when done or failed for good; False: try the store instead."""
    from envbuild.store._http import put_bytes
    from envbuild.store.base import StoreError, encode_record

    try:
        got = put_bytes(put_url, encode_record(record))
    except StoreError as e:
        log.warning("save lazy profile %s: %s", key, e)
        return True
    if 200 <= got.status < 300:
        log.info("saved lazy profile %s (%d files) through its presigned URL", key, files)
        return True
    log.warning("save lazy profile %s through its presigned URL: %s; through the "
                "store instead", key, got.error or f"HTTP {got.status}")
    return False
