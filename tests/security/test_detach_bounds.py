"""Detached commands (agent protocol 3) cannot grow the agent: a command that prints as fast
as it can while detached costs the agent at most ``DETACH_BUF`` (the rest is read, dropped and
counted, and the command runs on), and at most ``MAX_DETACHED`` commands are detached at once.
Real runc sandbox, real agent (its memory read from ``/proc/1/status`` in the sandbox)."""

from __future__ import annotations

import time

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim import Sandbox
from runtime_shim.isolation.agent_wire import DETACH_BUF, MAX_DETACHED

KiB = 1 << 10


def _agent_rss_kib(sb: Sandbox) -> int:
    line = sb.exec("grep '^VmRSS:' /proc/1/status").stdout.decode()
    return int(line.split()[1])


def test_a_detached_flood_is_dropped_past_the_bound(busybox_store):
    store, node = busybox_store
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node) as sb:
        base = _agent_rss_kib(sb)
        proc = sb.start("cat /dev/zero", detachable=True)
        pid = proc.detach()
        assert pid
        time.sleep(2)  # gigabytes printed meanwhile, at pipe speed
        grown = _agent_rss_kib(sb) - base
        assert grown < 2 * DETACH_BUF // KiB + 512, f"the agent grew by {grown} KiB"
        got: list[int] = []
        again = sb.reattach(pid, on_stdout=lambda b: got.append(len(b)))
        deadline = time.monotonic() + 10
        while sum(got) < DETACH_BUF // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert again.dropped > 64 * DETACH_BUF  # it ran on (and printed) while detached
        again.kill()
        result = again.wait(10)
        assert result.exit_code == 137


def test_at_most_max_detached_commands(busybox_store):
    store, node = busybox_store
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node) as sb:
        ids = [sb.start("sleep 60", detachable=True).detach() for _ in range(MAX_DETACHED)]
        assert len(set(ids)) == MAX_DETACHED and all(ids)
        extra = sb.start("sleep 60", detachable=True)
        with pytest.raises(RuntimeShimError, match="too many detached commands"):
            extra.detach()
        assert sb.exec("pgrep -c sleep || ps | grep -c '[s]leep 60'").stdout.strip() == \
            str(MAX_DETACHED).encode()  # the refused one was ended
        again = sb.reattach(ids[0])
        again.kill()
        assert again.wait(10).exit_code == 137
        assert sb.start("sleep 60", detachable=True).detach()  # a slot is free again
