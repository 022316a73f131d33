"""Build leases (envbuild.store.lease) on a MemoryStore: one builder per key, waiters get the
record, expired leases are taken over by exactly one waiter, holders renew and release."""

from __future__ import annotations

import threading
import time

import pytest

from envbuild.errors import BuildError
from envbuild.store import KeyRecord, MemoryStore, put_key_record
from envbuild.store.lease import LEASES, Lease, claim, is_expired

KEY = "sha256:" + "ab" * 32
HEX = KEY[7:]
RECORD = KeyRecord(layer="sha256:" + "01" * 32, toc="sha256:" + "02" * 32,
                   diff_id="sha256:" + "03" * 32, size=7)


def test_first_claim_holds_the_lease_and_release_drops_it():
    store = MemoryStore()
    lease = claim(store, KEY, ttl=5)
    assert isinstance(lease, Lease) and lease.exclusive
    held = store.get_record(LEASES, HEX)
    assert held["owner"] == lease.owner and held["expires"] > time.time()
    lease.release()
    assert store.get_record(LEASES, HEX) is None


def test_a_built_key_needs_no_lease():
    store = MemoryStore()
    put_key_record(store, KEY, RECORD)
    assert claim(store, KEY) == RECORD
    assert store.get_record(LEASES, HEX) is None


def test_second_builder_waits_for_the_record_instead_of_building():
    store = MemoryStore()
    first = claim(store, KEY, ttl=5)
    assert isinstance(first, Lease)
    waited = []
    result = {}

    def second():
        result["got"] = claim(store, KEY, ttl=5, poll=0.02, on_wait=waited.append)

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and waited and waited[0]["owner"] == first.owner
    put_key_record(store, KEY, RECORD)  # blob first, record second, then the lease goes
    first.release()
    t.join(5)
    assert result["got"] == RECORD


def test_expired_lease_is_taken_over_by_exactly_one_of_many_waiters():
    store = MemoryStore()
    stale = {"version": 1, "owner": "dead", "host": "elsewhere", "boot_id": "x", "pidns": "y",
             "pid": 1, "ttl": 1, "acquired": time.time() - 10, "expires": time.time() - 5}
    assert store.create_record(LEASES, HEX, stale)
    barrier = threading.Barrier(8)
    got: list = []

    def waiter():
        barrier.wait()
        got.append(claim(store, KEY, ttl=5, poll=0.01))

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    holders = [g for g in got if isinstance(g, Lease)]
    assert len(holders) == 1 and holders[0].took_over
    put_key_record(store, KEY, RECORD)
    holders[0].release()
    for t in threads:
        t.join(5)
    assert len(got) == 8 and got.count(RECORD) == 7


def test_holder_renews_and_a_takeover_is_noticed_as_lost():
    store = MemoryStore()
    lease = claim(store, KEY, ttl=0.3)
    assert isinstance(lease, Lease)
    with lease:
        first = store.get_record(LEASES, HEX)["expires"]
        time.sleep(0.5)  # longer than the ttl: only renewals keep it alive
        now = store.get_record_tagged(LEASES, HEX)
        assert now[0]["expires"] > first and not is_expired(now[0])
        # someone overwrites it (a waiter that saw it expired while we were stalled)
        store.put_record(LEASES, HEX, {**now[0], "owner": "thief"})
        time.sleep(0.3)
        assert lease.lost.is_set()
    assert store.get_record(LEASES, HEX)["owner"] == "thief"  # ours to drop no longer


def test_lease_of_a_dead_local_process_is_expired_at_once():
    import os

    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    dead = next(p for p in range(pid_max - 1, 1, -1) if not os.path.exists(f"/proc/{p}"))
    lease = claim(MemoryStore(), KEY, ttl=60)
    assert isinstance(lease, Lease)
    mine = dict(lease.record)
    assert is_expired({**mine, "pid": dead})
    assert not is_expired({**mine, "pid": 1})  # init is alive
    assert not is_expired({**mine, "boot_id": "another-host", "pid": dead})
    assert is_expired({**mine, "version": 2})


def test_cancel_while_waiting():
    store = MemoryStore()
    first = claim(store, KEY, ttl=5)
    cancelled = threading.Event()
    threading.Timer(0.1, cancelled.set).start()
    with pytest.raises(BuildError):
        claim(store, KEY, cancelled=cancelled, poll=0.02)
    assert isinstance(first, Lease)
    first.release()
