"""Build leases: at most one builder per layer key at a time, across processes and machines.

A builder about to build key K takes a *lease* on it: a conditional create of the record
``leases/v1/<K-hex>`` (``ConditionalRecords.create_record``: ``If-None-Match: *`` on S3, an
exclusive ``link(2)`` in a local store), holding who it is and when the lease expires. While
the build runs a thread renews it (a conditional replace of exactly the version it wrote, every
``ttl / 3`` seconds); when the build ends the lease is deleted (conditionally: never someone
else's). Another builder of K meanwhile *waits*: it polls for K's key record and returns it as
soon as it exists, without building. A lease past its expiry (its builder died or lost the
network) is taken over with a conditional replace, so of several waiters exactly one wins.

The key record stays the only truth. A lease says "someone is building this", never "this is
built": the builder stores the blob, then the key record, then drops the lease; a waiter that
gets the lease re-reads the key record before building (the previous holder may have published
between the waiter's look and its create). A lease that outlives its builder only delays
others by at most ``ttl``; a holder that was stalled past its expiry and loses the lease finds
out at its next renewal (``Lease.lost``) -- if it still publishes, it publishes the same
content-addressed layer a second time, which is harmless (last writer of the record wins).

Lease record format (version 1)::

    {"version": 1, "owner": "<uuid>", "host": "<hostname>", "boot_id": "...", "pidns": "...",
     "pid": 1234, "label": "<free text, e.g. the Ray node>", "ttl": 30.0,
     "acquired": <unix time>, "expires": <unix time>}

Expiry compares the holder's wall clock with the waiter's (hosts are assumed NTP-synced to well
under ``ttl``). On one host (same ``boot_id`` and PID namespace) a lease whose ``pid`` no
longer exists is expired at once: a killed local build does not hold up the next one for
``ttl`` seconds.

Stores without ``ConditionalRecords`` (an OCI registry, an S3 server that ignores conditions)
get no lease: ``claim`` returns a ``Lease`` that guards nothing (``exclusive`` false) and the
build goes ahead, as before leases existed.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from envbuild.errors import BuildError, StoreError
from envbuild.store.base import ConditionalRecords, Store, check_digest
from envbuild.store.helpers import KeyRecord, get_key_record

#: Namespace of lease records.
LEASES = "leases/v1"
LEASE_VERSION = 1
#: Default lease lifetime (seconds): how long a dead builder can hold up others.
DEFAULT_TTL = 30.0
#: How often a waiter looks for the key record / an expired lease (seconds, jittered).
DEFAULT_POLL = 0.25


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pidns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_HOST = (socket.gethostname(), _boot_id(), _pidns())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_expired(lease: dict[str, Any], now: float | None = None) -> bool:
    """Whether a lease record no longer protects its key: past ``expires``, malformed, of an
    unknown version, or held by a process of this host that no longer exists."""
    now = time.time() if now is None else now
    if lease.get("version") != LEASE_VERSION:
        return True
    expires = lease.get("expires")
    if not isinstance(expires, (int, float)) or expires <= now:
        return True
    pid = lease.get("pid")
    if (lease.get("boot_id"), lease.get("pidns")) == (_HOST[1], _HOST[2]) and _HOST[1] \
            and isinstance(pid, int) and pid > 0 and pid != os.getpid():
        return not _pid_alive(pid)
    return False


@dataclasses.dataclass
class Lease:
    """A held lease (``exclusive``), renewed by a thread until ``release``. ``lost`` is set
    when a renewal found the lease taken over (this holder had stalled past its expiry)."""

    store: Store
    key_hex: str
    owner: str
    tag: str | None
    ttl: float
    record: dict[str, Any]
    exclusive: bool = True
    took_over: bool = False
    lost: threading.Event = dataclasses.field(default_factory=threading.Event)
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start_renewing(self) -> None:
        if not self.exclusive or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                        name=f"lease-{self.key_hex[:12]}")
        self._thread.start()

    def _renew_loop(self) -> None:
        assert isinstance(self.store, ConditionalRecords)
        while not self._stop.wait(self.ttl / 3):
            now = time.time()
            body = {**self.record, "expires": now + self.ttl}
            try:
                tag = self.store.replace_record(LEASES, self.key_hex, body, self.tag or "")
            except StoreError:
                continue  # transient: try again next period (still ttl * 2/3 to go)
            if tag is None:
                self.lost.set()
                return
            self.tag, self.record = tag, body

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this holder's; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.exclusive and self.tag is not None and not self.lost.is_set():
            assert isinstance(self.store, ConditionalRecords)
            try:
                self.store.delete_record_if(LEASES, self.key_hex, self.tag)
            except StoreError:
                pass  # it expires on its own
            self.tag = None

    def __enter__(self) -> Lease:
        self.start_renewing()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim(store: Store, key: str, *, ttl: float = DEFAULT_TTL,
          cancelled: threading.Event | None = None, poll: float = DEFAULT_POLL,
          label: str = "", ignore_existing: bool = False, checked: bool = False,
          on_wait: Callable[[dict[str, Any]], None] | None = None) -> Lease | KeyRecord:
    """Take the lease on layer key ``key``, or wait until its key record exists.

    Returns the ``KeyRecord`` when the key is (or becomes) built by someone else, else a
    ``Lease`` the caller now holds (use it as a context manager around the build: it renews
    and releases). ``ignore_existing`` (``--no-cache``) only waits for a running build to
    finish, then builds anyway. ``on_wait(lease_record)`` is called once when the key turns
    out to be leased by another builder. ``cancelled`` set while waiting raises ``BuildError``.
    ``checked``: the caller has just looked for the key record (saves one store read).
    """
    key_hex = check_digest(key)
    owner = uuid.uuid4().hex
    if not isinstance(store, ConditionalRecords) or not store.supports_cas:
        return Lease(store, key_hex, owner, None, ttl, {}, exclusive=False)
    waited = False
    while True:
        if not ignore_existing and not checked:
            existing = get_key_record(store, key)
            if existing is not None:
                return existing
        now = time.time()
        body = {"version": LEASE_VERSION, "owner": owner, "host": _HOST[0], "boot_id": _HOST[1],
                "pidns": _HOST[2], "pid": os.getpid(), "label": label, "ttl": ttl,
                "acquired": now, "expires": now + ttl}
        lease, current = _try_take(store, key_hex, owner, ttl, body, now)
        if current is not None and not waited:
            waited = True
            if on_wait is not None:
                on_wait(current)
        checked = False
        if lease is not None:
            # the previous holder may have published between our look and our create
            existing = None if ignore_existing else get_key_record(store, key)
            if existing is not None:
                lease.release()
                return existing
            return lease
        if cancelled is not None:
            if cancelled.wait(poll * random.uniform(0.5, 1.5)):
                raise BuildError("cancelled while waiting for another builder of this layer",
                                 hint="nothing was published for this layer")
        else:
            time.sleep(poll * random.uniform(0.5, 1.5))


def _try_take(store: Any, key_hex: str, owner: str, ttl: float, body: dict[str, Any],
              now: float) -> tuple[Lease | None, dict[str, Any] | None]:
    """One attempt at the lease record: (the lease we now hold, None), or (None, the record of
    the builder holding it), or (None, None) when it was released between our create and
    read (go round and create again)."""
    created = store.create_record(LEASES, key_hex, body)
    if created is not None:
        return Lease(store, key_hex, owner, created, ttl, body), None
    got = store.get_record_tagged(LEASES, key_hex)
    if got is None:
        return None, None
    current, tag = got
    if current.get("owner") == owner:  # our retried create had landed
        return Lease(store, key_hex, owner, tag, ttl, body), None
    if is_expired(current, now):
        new_tag = store.replace_record(LEASES, key_hex, body, tag)
        if new_tag is not None:
            return Lease(store, key_hex, owner, new_tag, ttl, body, took_over=True), None
        return None, None
    return None, current
