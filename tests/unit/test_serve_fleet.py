"""``envbuild.serve.fleet.FleetBackend`` on the fleet's real control plane without Ray (stub
daemons, ``tests.fleet_stub``): the backend keeps the leases of the sandboxes it serves alive
past their length, a sandbox it stopped serving is reaped by its node, an expired one cannot
be attached again, and what a fleet sandbox lacks (a PTY, a watch, a pause or snapshot with
memory) is refused as ``Unsupported``."""

from __future__ import annotations

import asyncio
import errno

import pytest

from envbuild.errors import SandboxNotFound
from envbuild.serve.fleet import FleetBackend, Unsupported
from tests.fleet_stub import stub_cell

LEASE = 1.0


@pytest.fixture
def cell(tmp_path):
    cell = stub_cell(tmp_path, nodes=2, reap_interval=0.05)
    yield cell
    cell.close()


def _live(fleet) -> set[str]:
    return {r.id for r in fleet.list()}


def test_served_sandboxes_outlive_their_lease_and_others_do_not(cell):
    fleet = cell.fleet()
    backend = FleetBackend(fleet, lease=LEASE, threads=4)

    async def scenario() -> tuple[set[str], set[str], str, str]:
        kept = await backend.create(cell.lock)
        dropped = await backend.create(cell.lock)
        assert kept.lock.digest == cell.lock and ("envbuild-serve", "1") in \
            fleet.list()[0].labels
        backend._served.pop(dropped.id)  # no longer served: its lease runs out
        await asyncio.sleep(LEASE * 2)
        alive = _live(fleet)
        await kept.close()
        return alive, _live(fleet), kept.id, dropped.id

    alive, after, kept, dropped = asyncio.run(scenario())
    assert alive == {kept}, "the served one renewed, the other reaped"
    assert after == set()
    with pytest.raises(SandboxNotFound):
        asyncio.run(backend.attach(dropped))


def test_what_a_fleet_sandbox_lacks_is_unsupported(cell):
    backend = FleetBackend(cell.fleet(), lease=60, threads=4)

    async def scenario() -> None:
        sb = await backend.create(cell.lock)
        assert (await backend.attach(sb.id)).id == sb.id
        assert not sb.streams, "stub daemons without --data-host"
        with pytest.raises(Unsupported, match="a PTY is not available for a fleet sandbox "
                                              "without the nodes' data plane") as pty:
            await sb.start(["sh"], pty=(24, 80))
        assert "--data-host" in (pty.value.hint or "")
        command = await sb.start(["true"])  # an exec through the control calls
        assert (await command.wait()).exit_code == 0
        for control in (lambda: command.write_stdin(b"x"), lambda: command.send_signal(9)):
            with pytest.raises(Unsupported, match="without the nodes' data plane"):
                control()
        for refused in (sb.watch("/tmp"), sb.connect_port(8080, 5.0)):
            with pytest.raises(OSError, match="without the nodes' data plane") as e:
                await refused
            assert e.value.errno == errno.EOPNOTSUPP
        for call in (backend.pause(sb, "i0", memory=True), backend.snapshot(sb, "s", memory=True),
                     backend.resume("sha256:" + "0" * 64, memory=True)):
            with pytest.raises(Unsupported, match="with memory is not available for a fleet "
                                                  "sandbox .* ask for mode='filesystem'$"):
                await call
        backend.forget("i0")  # no paused ref: nothing to drop, no error
        await sb.write_file("/f", b"x")
        assert await sb.read_file("/f") == b"x"
        await sb.close()

    asyncio.run(scenario())
