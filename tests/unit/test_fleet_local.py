"""The fleet's control plane without Ray (``runtime_shim.fleet.calls.LocalCalls``): the real
``Fleet`` and ``NodeDaemon``s whose node start is a stub. A status view asks each node once
per TTL and plans again when a node refuses; admission and status read counters, not every
sandbox of the node; the counters agree with the entries."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest

from envbuild.errors import RuntimeShimError
from envbuild.store import LocalStore
from runtime_shim.backends.fake import fake_lock
from runtime_shim.fleet.leases import Entry, EntryTable
from runtime_shim.fleet.model import CreateSpec, DaemonConfig, memory_of
from runtime_shim.node.model import Limits
from tests.fleet_stub import StubDaemon, stub_cell


@pytest.fixture
def cell(tmp_path):
    cell = stub_cell(tmp_path)
    yield SimpleNamespace(fleet=lambda status_ttl: cell.fleet(status_ttl=status_ttl),
                          daemons=cell.daemons, calls=cell.calls, lock=cell.lock)
    cell.close()


def test_without_a_view_every_create_asks_every_node(cell):
    fleet = cell.fleet(0.0)
    for _ in range(4):
        fleet.create(cell.lock, n=3)
    assert cell.calls.counts["status"] == 4 * 3


def test_a_stream_of_creates_asks_each_node_once_per_ttl_and_counts_its_own(cell):
    fleet = cell.fleet(60.0)
    made = [sb for _ in range(9) for sb in fleet.create(cell.lock, n=3)]
    assert cell.calls.counts["status"] == 3, "one status call per node for the whole stream"
    per_node = {nid: len(d._entries) for nid, d in cell.daemons.items()}
    assert per_node == dict.fromkeys(cell.daemons, 9), "the view spread them as fresh status would"
    assert len({sb.id for sb in made}) == 27


def test_a_node_fuller_than_the_view_refuses_and_the_client_plans_again(cell):
    fleet = cell.fleet(60.0)
    fleet.create(cell.lock, n=3)  # the view: 9 free slots on each node
    other = cell.fleet(0.0)  # another driver fills two nodes
    full = sorted(cell.daemons)[:2]
    for nid in full:
        other._create_batches([(fleet._spec(cell.lock, backend="container", lazy=False,
                                            network=False, limits=None, ttl=None,
                                            exec_log=False, labels=None, seccomp=None)[0],
                                {nid: 9})])
    made = fleet.create(cell.lock, n=6)
    assert {sb.node_id for sb in made} == set(cell.daemons) - set(full)
    with pytest.raises(RuntimeShimError) as e:
        fleet.create(cell.lock, n=4)
    assert e.value.reference == "fleet-full"
    assert sum(len(d._entries) for d in cell.daemons.values()) == 27, "nothing half-made"


class NoScan(EntryTable):
    """Refuses to be iterated: admission and status must not read every entry."""

    def values(self):
        raise AssertionError("scanned every entry")

    items = keys = __iter__ = values


def test_admission_and_status_read_no_entry_of_the_node(cell):
    daemon = next(iter(cell.daemons.values()))
    table = NoScan()
    for e in daemon._entries.values():
        table[e.sandbox.id] = e
    daemon._entries = table
    spec = CreateSpec(lock=cell.lock, limits=Limits(memory_bytes=1 << 20))
    assert len(daemon.create_batch(spec, 4)) == 4
    status = daemon.status(pool_keys=(spec.pool_key(),))
    assert (status.used, status.memory_used, status.warm) == (4, 4 << 20, 0)
    daemon._entries = EntryTable()  # shutdown may read them all
    for key, e in dict.items(table):
        daemon._entries[key] = e


def test_entry_table_counters_agree_with_the_entries():
    table = EntryTable()
    rng = random.Random(3)
    specs = [CreateSpec(lock="sha256:" + "0" * 64, limits=Limits(memory_bytes=m))
             for m in (1 << 20, 3 << 20, None)]
    for step in range(2000):
        key = f"eb-{rng.randrange(60):012x}"
        if rng.random() < 0.6:
            table[key] = Entry(sandbox=None, spec=rng.choice(specs), lease_expires=0.0,
                               exec_log=None, pool=rng.choice([None, "p1", "p2"]))
        else:
            table.pop(key, None)
        if step % 97 == 0:
            assert table.memory == sum(memory_of(e.spec) for e in dict.values(table))
            for pool in ("p1", "p2"):
                want = [k for k, e in dict.items(table) if e.pool == pool]
                assert sorted(table.pool_ids(pool, 1000)) == sorted(want)
                assert table.pool_count(pool) == len(want)
            assert table.pooled_total == sum(1 for e in dict.values(table) if e.pool)
    table.clear()
    assert (len(table), table.memory, table.pooled_total) == (0, 0, 0)


def test_the_reaper_closes_ended_leases_without_reading_every_entry(tmp_path):
    store = LocalStore(tmp_path / "store")
    digest = fake_lock(store)
    config = DaemonConfig(store=str(tmp_path / "store"), node_dir=str(tmp_path / "{node_id}"),
                          niceness=None, reap_interval=0.05)
    daemon = StubDaemon(config, "1" * 40)
    daemon._entries = NoScan()
    try:
        short = daemon.create_batch(CreateSpec(lock=digest, ttl=0.3), 3)
        daemon.create_batch(CreateSpec(lock=digest, ttl=60), 2)
        daemon.renew(short[0].id.split("@")[0], 60)
        time.sleep(1.0)
        assert len(daemon._entries) == 3, "the two short leases not renewed were reaped"
        assert short[0].id.split("@")[0] in daemon._entries
    finally:
        daemon._entries = EntryTable()
        daemon.shutdown()


def test_entry_table_leases_end_in_order_and_renewals_count():
    table = EntryTable()
    spec = CreateSpec(lock="sha256:" + "0" * 64)
    for i, end in enumerate((5.0, 1.0, 3.0)):
        table[f"k{i}"] = Entry(sandbox=None, spec=spec, lease_expires=end, exec_log=None)
    table["pooled"] = Entry(sandbox=None, spec=spec, lease_expires=0.0, exec_log=None, pool="p")
    assert table.expired(0.5) == []
    table["k1"].lease_expires = 4.0
    table.leased("k1")
    assert table.expired(3.5) == ["k2"], "k1 was renewed past 3.5"
    table.pop("k0")
    assert table.expired(10.0) == ["k1"]
