"""The sweep index (``runtime_shim.node.owners``): a full sweep is needed only when a creator
is gone, an expiry passed, or the index is new; after a sweep it forgets what it may."""

from __future__ import annotations

import multiprocessing
import os
import time

from runtime_shim.node import owners
from runtime_shim.node.layout import NodeLayout


def _registered_by_a_child(layout: NodeLayout) -> int:
    """The pid of a (forked) process that registered on ``layout`` and exited."""
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=owners.register, args=(layout,))
    child.start()
    child.join()
    assert child.exitcode == 0
    return child.pid


def test_a_new_index_asks_for_one_full_sweep(tmp_path):
    layout = NodeLayout(tmp_path)
    assert owners.sweep_needed(layout, time.time())
    owners.after_sweep(layout, [], time.time())
    assert not owners.sweep_needed(layout, time.time())


def test_a_creator_that_is_gone_asks_for_a_sweep_until_nothing_of_it_is_left(tmp_path):
    layout = NodeLayout(tmp_path)
    owners.register(layout)
    owners.after_sweep(layout, [], time.time())
    assert not owners.sweep_needed(layout, time.time())   # this process is alive
    pid = _registered_by_a_child(layout)
    assert owners.sweep_needed(layout, time.time())
    # its sandbox could not be removed: keep asking
    owners.after_sweep(layout, [(pid, False, 0.0)], time.time())
    assert owners.sweep_needed(layout, time.time())
    # only a kept one is left: its death no longer matters (kept ones go by their TTL)
    owners.after_sweep(layout, [(pid, True, 0.0)], time.time())
    assert not owners.sweep_needed(layout, time.time())
    assert {p.name.split("-")[0] for p in layout.owners.iterdir()} >= {str(os.getpid())}
    assert not any(p.name.startswith(f"{pid}-") for p in layout.owners.iterdir())


def test_the_earliest_expiry_asks_for_a_sweep_when_it_passes(tmp_path):
    layout = NodeLayout(tmp_path)
    now = time.time()
    owners.after_sweep(layout, [], now)
    owners.register(layout, expires=now + 100)
    owners.register(layout, expires=now + 50)
    owners.register(layout, expires=now + 70)
    assert not owners.sweep_needed(layout, now + 49)
    assert owners.sweep_needed(layout, now + 51)
    owners.after_sweep(layout, [(os.getpid(), False, now + 100)], time.time() + 1)
    assert not owners.sweep_needed(layout, now + 51) and owners.sweep_needed(layout, now + 101)


def test_an_expiry_registered_during_a_sweep_is_kept(tmp_path):
    layout = NodeLayout(tmp_path)
    started = time.time() - 1          # the sweep listed the records before this create
    owners.register(layout, expires=started + 30)
    owners.after_sweep(layout, [], started)
    assert owners.sweep_needed(layout, started + 31)


def test_a_reused_pid_is_not_the_creator():
    me = os.getpid()
    start = owners.process_start(me)
    assert start is not None and owners.owner_alive(me, start)
    assert not owners.owner_alive(me, start + 1)
    assert owners.owner_alive(me, None) and not owners.owner_alive(0, None)


def test_a_sweep_of_a_node_dir_never_made_notes_nothing(tmp_path):
    layout = NodeLayout(tmp_path / "never-made")
    owners.after_sweep(layout, [], time.time())
    assert not (tmp_path / "never-made").exists()
