"""``envbuild serve --fleet ADDRESS`` (issue 37 item 4): the unmodified e2b SDK against a real
server process whose sandboxes are placed on the session's real 2-node Ray cluster
(``ray_cluster``), real runc sandboxes on the nodes' daemons (with their data plane): create,
commands, files, list, kill, stdin, signals, PTYs and ports over the data plane's streams
(and ``FleetSandbox.start`` itself), a server restart that re-attaches, what a fleet sandbox
refuses (one line each), pause, snapshots and fork (files only), and the CLI's one line for an
address nothing listens at."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from envbuild.errors import EnvbuildError, RuntimeShimError
from tests.conftest import REPO
from tests.e2b_server import assert_run_times_out, e2b_env, running_server
from tests.integration.test_e2b_watch import _names
from tests.security.test_e2b_network import _reachable, site  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration
TEMPLATE = "busybox-shell"
#: each sandbox small (the nodes' admission counts them), as tests/integration/test_fleet.py
SIZES = ("--memory", "64MiB", "--pids", "32", "--nofile", "256")


@contextmanager
def fleet_daemons(address: str, store: Path, nodes: Path) -> Iterator[object]:
    """The fleet's daemons on the cluster at ``address`` over the directory store ``store``
    (node dirs under ``nodes``, data plane on 127.0.0.1), as this process's ``Fleet``, which
    checks what a server did; afterwards no daemon, sandbox or mount of the fleet is left.
    Also the fleet mode of ``tests/integration/e2b_upstream`` (its conftest)."""
    import ray

    from runtime_shim.fleet import Fleet
    from tests.integration.test_fleet import _daemon_actors, _mounts_under, _sandbox_dirs

    ray.init(address=address, namespace="envbuild", log_to_driver=False,
             ignore_reinit_error=True)
    fleet = Fleet.connect(address=address, store=str(store), node_dir=str(nodes / "{node_id}"),
                          slots=16, data_host="127.0.0.1")
    try:
        yield fleet
    finally:
        fleet.stop_daemons()
        try:
            assert _daemon_actors() == []
            assert _sandbox_dirs(nodes) == []
            assert _mounts_under(nodes) == []
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def cell(ray_cluster, tmp_path_factory):
    """The busybox env in a directory store, the fleet's daemons started on it
    (``fleet_daemons``)."""
    from tests.integration.conftest import build_busybox_env

    root = tmp_path_factory.mktemp("e2bfleet")
    store, _ = build_busybox_env(root / "built")
    nodes = root / "nodes"
    with fleet_daemons(ray_cluster.address, store.root, nodes) as fleet:
        yield {"address": ray_cluster.address, "store": store.root, "fleet": fleet,
               "nodes": nodes}


def _served(fleet) -> list[str]:
    return [r.id for r in fleet.list({"envbuild-serve": "1"})]


def test_the_sdk_drives_fleet_sandboxes(cell, tmp_path):
    from e2b import CommandExitException, Sandbox

    fleet = cell["fleet"]
    with running_server(tmp_path, cell["store"], tmp_path / "node",
                        args=("--fleet", cell["address"], *SIZES)) as srv, e2b_env(srv):
        sb = Sandbox.create(TEMPLATE, timeout=120, metadata={"on": "fleet"})
        other = Sandbox.create(TEMPLATE, timeout=120)
        placed = _served(fleet)
        assert len(placed) == 2, placed
        assert {i.split("@")[1] for i in placed} <= {n[:12] for n in fleet.node_ids}

        seen: list[str] = []
        r = sb.commands.run("echo out; echo err >&2; echo $GREET; pwd", envs={"GREET": "hi"},
                            cwd="/tmp", on_stdout=seen.append)
        assert (r.exit_code, r.stdout, r.stderr) == (0, "out\nhi\n/tmp\n", "err\n")
        assert "".join(seen) == r.stdout, "streamed as it came"
        with pytest.raises(CommandExitException) as failed:
            sb.commands.run("exit 3")
        assert failed.value.exit_code == 3
        bg = sb.commands.run("sleep 0.5; echo later", background=True)
        assert bg.wait().stdout == "later\n"
        assert sb.commands.run("id -u", user="root").stdout == "0\n"
        assert_run_times_out(sb)  # the node ends the command with its deadline

        sb.files.write("/tmp/note.txt", "from the fleet")
        assert sb.files.read("/tmp/note.txt") == "from the fleet"
        assert other.files.exists("/tmp/note.txt") is False, "each sandbox its own files"
        sb.files.write("/tmp/blob", bytes(range(256)) * 4096)
        assert sb.files.read("/tmp/blob", format="bytes") == bytes(range(256)) * 4096
        sb.files.write("/tmp/agent.txt", iter([b"a", b"b"]), user="agent")  # octet-stream
        assert sb.files.get_info("/tmp/agent.txt").owner == "agent"
        assert sb.files.read("/tmp/agent.txt") == "ab"
        assert Sandbox.list_snapshots().next_items() == []  # the fleet store's: none
        assert "note.txt" in {e.name for e in sb.files.list("/tmp")}
        sb.files.rename("/tmp/note.txt", "/tmp/moved.txt")
        assert sb.commands.run("cat /tmp/moved.txt").stdout == "from the fleet"

        listed = {s.sandbox_id: s for s in Sandbox.list().next_items()}
        assert set(listed) == {sb.sandbox_id, other.sandbox_id}
        assert listed[sb.sandbox_id].metadata == {"on": "fleet"}
        sb.kill()
        assert _served(fleet) == [i for i in placed if i in _served(fleet)]
        assert len(_served(fleet)) == 1 and not sb.is_running()
        assert [s.sandbox_id for s in Sandbox.list().next_items()] == [other.sandbox_id]
    assert _served(fleet) == [], "--on-exit kill closed the fleet's sandboxes too"


def test_stdin_signals_ptys_ports_and_watches_of_fleet_sandboxes(cell, tmp_path):
    """Over the nodes' data plane (``runtime_shim.fleet.streams``): ``commands.run`` with
    stdin, ``send_stdin``, ``commands.kill``, a PTY (create, input, resize, kill),
    ``get_host`` to an HTTP server in the sandbox and ``watch_dir``; pause is refused in one
    line."""
    from e2b import CommandExitException, PtySize, Sandbox, SandboxException

    with running_server(tmp_path, cell["store"], tmp_path / "node",
                        args=("--fleet", cell["address"], *SIZES)) as srv, e2b_env(srv):
        sb = Sandbox.create(TEMPLATE, timeout=120)
        cat = sb.commands.run("cat; echo eof", background=True, stdin=True)
        sb.commands.send_stdin(cat.pid, "to stdin\n")
        sb.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "to stdin\neof\n"

        sleeper = sb.commands.run("sleep 60", background=True)
        assert sb.commands.kill(sleeper.pid) is True
        with pytest.raises(CommandExitException) as killed:
            sleeper.wait()
        assert killed.value.exit_code != 0
        assert sleeper.pid not in {p.pid for p in sb.commands.list()}

        term = sb.pty.create(PtySize(rows=24, cols=80))
        sb.pty.resize(term.pid, PtySize(rows=33, cols=101))
        sb.pty.send_stdin(term.pid, b"stty size; exit 5\n")
        screen: list[bytes] = []
        with pytest.raises(CommandExitException) as ended:
            term.wait(on_pty=screen.append)
        assert ended.value.exit_code == 5 and b"33 101" in b"".join(screen)
        other = sb.pty.create(PtySize(rows=24, cols=80))
        assert sb.pty.kill(other.pid) is True
        with pytest.raises(CommandExitException):
            other.wait()

        sb.files.write("/tmp/www/index.html", "from the fleet's node")
        sb.commands.run("busybox httpd -f -p 8080 -h /tmp/www", background=True)
        headers = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8080",
                   "e2b-traffic-access-token": sb.traffic_access_token}
        deadline = time.monotonic() + 20
        while (r := httpx.get(srv.url + "/index.html", headers=headers)).status_code == 502:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert (r.status_code, r.text) == (200, "from the fleet's node")
        host = sb.get_host(8080)
        r = httpx.get(srv.url + "/index.html", headers={
            "Host": host, "e2b-traffic-access-token": sb.traffic_access_token})
        assert (r.status_code, r.text) == (200, "from the fleet's node")
        r = httpx.get(srv.url + "/", headers={**headers, "E2b-Sandbox-Port": "8081"})
        assert r.status_code == 502, "nothing listens there: the proxy's answer"

        sb.files.make_dir("/tmp/w/sub")
        watch = sb.files.watch_dir("/tmp/w", recursive=True)
        sb.commands.run("echo 1 > /tmp/w/a; echo 2 > /tmp/w/sub/b; rm /tmp/w/a")
        seen: set = set()
        want = {("create", "a"), ("write", "a"), ("remove", "a"), ("create", "sub/b")}
        deadline = time.monotonic() + 20
        while not want <= seen and time.monotonic() < deadline:
            seen |= _names(watch.get_new_events())
            time.sleep(0.1)
        assert want <= seen, seen
        watch.stop()
        with pytest.raises(SandboxException):
            sb.files.watch_dir("/tmp/nothing-here")

        with pytest.raises(SandboxException, match="a pause with memory is not available here"):
            sb.pause()
        sb.kill()
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def test_a_fleet_sandbox_survives_a_server_restart(cell, tmp_path):
    """SIGTERM keeps the sandboxes; a new server re-attaches them from its records (the fleet
    ids), with their files and tokens; a killed one's record is gone."""
    from e2b import Sandbox

    fleet, node = cell["fleet"], tmp_path / "node"
    args = ("--fleet", cell["address"], *SIZES)
    with running_server(tmp_path, cell["store"], node, args=args, on_exit="keep") as srv, \
            e2b_env(srv):
        port = srv.url.rsplit(":", 1)[1]
        sb = Sandbox.create(TEMPLATE, timeout=120, metadata={"run": "restart"})
        sb.files.write("/tmp/mark", "before")
        placed = _served(fleet)
    assert _served(fleet) == placed and len(placed) == 1, "the sandbox outlives its server"
    (record,) = (node / "serve-fleet").glob("i*.json")
    assert placed[0] in record.read_text()
    with running_server(tmp_path, cell["store"], node,
                        args=(*args, "--listen", f"127.0.0.1:{port}")) as again, \
            e2b_env(again):
        assert sb.files.read("/tmp/mark") == "before", "the old token opens it again"
        assert Sandbox.get_info(sb.sandbox_id).metadata == {"run": "restart"}
        assert Sandbox.connect(sb.sandbox_id).commands.run("echo again").stdout == "again\n"
        sb.kill()
        assert _served(fleet) == []
    assert list((node / "serve-fleet").glob("i*.json")) == []


def test_warm_pools_serve_creates(cell, tmp_path):
    """``--warm ENV=1``: every node keeps a ready sandbox; an SDK create claims one (it was
    started before the create was asked), and the pool refills."""
    from e2b import Sandbox

    from runtime_shim import Limits

    fleet = cell["fleet"]
    limits = Limits(memory_bytes=64 << 20, pids=32, nofile=256)  # what SIZES makes
    try:
        with running_server(tmp_path, cell["store"], tmp_path / "node",
                            args=("--fleet", cell["address"], *SIZES, "--warm",
                                  f"{TEMPLATE}=1")) as srv, e2b_env(srv):
            deadline = time.monotonic() + 120
            while any(n.warm < 1 for n in fleet.nodes()):  # the server's --warm fills them
                assert time.monotonic() < deadline, fleet.nodes()
                time.sleep(0.2)
            before = time.time()
            sb = Sandbox.create(TEMPLATE, timeout=60)
            (record,) = fleet.list({"envbuild-serve": "1"})
            assert record.created < before, "claimed from a warm pool, not started"
            assert sb.commands.run("echo warm").stdout == "warm\n"
            sb.kill()
    finally:
        fleet.warm(TEMPLATE, per_node=0, limits=limits)  # pools outlive the server


def test_an_unreachable_fleet_is_one_line(cell, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "keys").write_text("k-0123456789\n")
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "envbuild.cli", "serve", "--fleet",
                        f"127.0.0.1:{port}", "--api-keys", str(tmp_path / "keys")],
                       env={**os.environ, "PYTHONPATH": str(REPO),
                            "ENVBUILD_STORE": str(cell["store"]),
                            "ENVBUILD_NODE_CACHE": str(tmp_path / "node")},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines()[0] == (f"error: cannot reach the Ray cluster at "
                                        f"127.0.0.1:{port}: Connection refused"), r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - started < 30
    assert not (tmp_path / "node" / "serve-fleet").exists(), "nothing half-made"


def test_network_rules_on_a_fleet_sandbox(cell, tmp_path, site):
    """E2B's network rules reach the node's sandbox (``FleetSandbox.set_network``); its
    metrics are empty (a fleet handle reports no usage), its logs hold its commands."""
    from e2b import Sandbox

    ten = site[0]["ten"]
    with running_server(tmp_path, cell["store"], tmp_path / "node",
                        args=("--fleet", cell["address"], *SIZES)) as srv, e2b_env(srv):
        sb = Sandbox.create(TEMPLATE, timeout=120, network={"deny_out": ["0.0.0.0/0"]})
        assert _reachable(sb, site) == set()
        sb.update_network({"allow_out": [ten], "deny_out": ["0.0.0.0/0"]})
        assert _reachable(sb, site) == {"ten"}
        assert sb.get_metrics() == []
        sb.kill()


def _paused_refs(store) -> list[str]:
    return [r for r in store.list_refs() if r.startswith("e2b/paused/")]


def test_pause_snapshot_and_fork_keep_a_fleet_sandboxs_files(cell, tmp_path, site):
    """Files only: a pause publishes the pack-diff under ``e2b/paused/<id>`` in the fleet's
    store and closes the node's sandbox, ``connect`` places a new one of it (files kept, the
    process not, the network rules too); a snapshot's sandboxes and a fork's children start
    from the files; asking for memory is refused in one line and the sandbox runs on."""
    from e2b import Sandbox, SandboxException

    from envbuild.store import open_store

    fleet, store = cell["fleet"], open_store(str(cell["store"]))
    ten, made = site[0]["ten"], []
    with running_server(tmp_path, cell["store"], tmp_path / "node",
                        args=("--fleet", cell["address"], *SIZES)) as srv, e2b_env(srv):
        sb = Sandbox.create(TEMPLATE, timeout=120, metadata={"role": "parent"},
                            network={"allow_out": [ten], "deny_out": ["0.0.0.0/0"]})
        made.append(sb)
        sb.files.write("/workspace/kept.txt", "on the fleet")
        sb.commands.run("sleep 600 > /dev/null 2>&1 &")
        with pytest.raises(SandboxException, match="a pause with memory is not available here "
                                                   r"\(this server keeps files only\): ask "
                                                   "for mode='filesystem'"):
            sb.pause()
        with pytest.raises(SandboxException, match="a snapshot with memory is not available"):
            sb.create_snapshot("full")
        assert sb.commands.run("cat /workspace/kept.txt").stdout == "on the fleet", "runs on"
        (before,) = _served(fleet)

        assert sb.pause(mode="filesystem") is True
        assert Sandbox.get_info(sb.sandbox_id).state.value == "paused"
        assert _served(fleet) == [] and _paused_refs(store) == [f"e2b/paused/{sb.sandbox_id}"]
        again = Sandbox.connect(sb.sandbox_id, timeout=120)
        assert again.files.read("/workspace/kept.txt") == "on the fleet"
        assert "sleep 600" not in again.commands.run("ps").stdout, "files only"
        assert _served(fleet) != [before] and len(_served(fleet)) == 1
        assert _paused_refs(store) == [], "resumed: the paused ref is dropped"
        assert _reachable(again, site) == {"ten"}, "its network rules follow it"

        snap = again.create_snapshot("fleet-files", mode="filesystem").snapshot_id
        assert snap == "e2b/fs-snapshots/fleet-files"
        assert [s.snapshot_id for s in Sandbox.list_snapshots().next_items()] == [snap]
        again.files.write("/workspace/kept.txt", "changed after")
        made.append(Sandbox.create(snap, timeout=120))
        assert made[-1].files.read("/workspace/kept.txt") == "on the fleet"

        children = again.fork(count=2, timeout=60)
        assert all(isinstance(c, Sandbox) for c in children), children
        made.extend(children)
        a, b = children
        assert len({sb.sandbox_id, a.sandbox_id, b.sandbox_id}) == 3
        assert a.get_info().metadata == {"role": "parent"}
        assert a.files.read("/workspace/kept.txt") == b.files.read("/workspace/kept.txt") == "changed after"
        a.files.write("/workspace/mine.txt", "a")
        assert not b.files.exists("/workspace/mine.txt") and not again.files.exists("/workspace/mine.txt")
        assert len(_served(fleet)) == 4 and _reachable(b, site) == {"ten"}
        sb.pause(mode="filesystem")  # killed while paused: its ref goes too
        assert len(_paused_refs(store)) == 1
        for s in made:
            s.kill()
        assert _paused_refs(store) == [] and _served(fleet) == []
        Sandbox.delete_snapshot(snap)
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def test_background_commands_stay_in_the_table_through_a_fork_and_refused_memory(cell,
                                                                                  tmp_path):
    """A fleet sandbox's commands are not detached (nothing is dumped): through a fork (files
    only) and a refused memory pause and snapshot, a background command stays listed and
    reachable by its pid (``commands.list``, ``send_stdin``, ``kill``), as E2B's upstream
    tests expect of the sandbox they go on using."""
    from e2b import CommandExitException, Sandbox, SandboxException

    with running_server(tmp_path, cell["store"], tmp_path / "node",
                        args=("--fleet", cell["address"], *SIZES)) as srv, e2b_env(srv):
        sb = Sandbox.create(TEMPLATE, timeout=120)
        reader = sb.commands.run('read line; echo "$line" > /tmp/got; exec sleep 600',
                                 background=True, stdin=True)
        for refused in (sb.pause, sb.create_snapshot):
            with pytest.raises(SandboxException, match="with memory is not available"):
                refused()
        children = sb.fork(count=1, timeout=60)
        assert all(isinstance(c, Sandbox) for c in children), children
        assert reader.pid in {p.pid for p in sb.commands.list()}
        sb.commands.send_stdin(reader.pid, "still here\n")
        deadline = time.monotonic() + 20
        while not sb.files.exists("/tmp/got") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sb.files.read("/tmp/got") == "still here\n"
        assert sb.commands.kill(reader.pid) is True
        with pytest.raises(CommandExitException):
            reader.wait()
        for s in (sb, *children):
            s.kill()


def test_a_fleet_sandbox_auto_pauses_its_files(cell, tmp_path):
    """``lifecycle`` with a files-only pause: at its timeout the sandbox is paused (its node's
    sandbox closed), and connect brings its files back; an auto-pause with memory is refused
    at create in one line (it could only end in a kill at the timeout)."""
    from e2b import Sandbox, SandboxException

    from tests.integration.test_e2b_autopause import _wait_paused

    fleet = cell["fleet"]
    with running_server(tmp_path, cell["store"], tmp_path / "node",
                        args=("--fleet", cell["address"], *SIZES)) as srv, e2b_env(srv):
        with pytest.raises(SandboxException, match="autoPause with memory is not available "
                                                   "here .* 'mode': 'filesystem'"):
            Sandbox.create(TEMPLATE, timeout=60, lifecycle={"on_timeout": "pause"})
        assert _served(fleet) == [] and Sandbox.list().next_items() == []
        sb = Sandbox.create(TEMPLATE, timeout=3, lifecycle={
            "on_timeout": {"action": "pause", "mode": "filesystem"}})
        sb.files.write("/workspace/auto.txt", "paused at the timeout")
        _wait_paused(sb)
        assert _served(fleet) == []
        again = Sandbox.connect(sb.sandbox_id, timeout=60)
        assert again.files.read("/workspace/auto.txt") == "paused at the timeout"
        again.kill()
        assert _served(fleet) == []


def _sized():
    from runtime_shim import Limits

    return Limits(memory_bytes=64 << 20, pids=32, nofile=256)  # what SIZES makes


def test_the_handle_starts_commands_over_the_data_plane(cell):
    """``FleetSandbox.start``: a command on the node streamed over the data plane, with stdin
    written and closed, its output as it comes, a signal, a PTY resized; a hang-up kills the
    command. ``FleetSandbox.watch``: a directory's events."""
    import signal as sig

    fleet = cell["fleet"]
    (sb,) = fleet.create(TEMPLATE, n=1, limits=_sized(), ttl=120)
    try:
        out: list[bytes] = []
        proc = sb.start(["sh", "-c", "cat; echo done >&2"], stdin=b"first ",
                        on_stdout=out.append, env={"A": "1"}, cwd="/tmp")
        proc.write_stdin("second")
        proc.close_stdin()
        r = proc.wait(30)
        assert (r.exit_code, r.stdout, r.stderr) == (0, b"first second", b"done\n")
        assert b"".join(out) == b"first second"
        with pytest.raises(RuntimeShimError, match="stdin is closed"):
            proc.write_stdin("late")
        for _ in range(5):  # output at once: after the start's reply
            assert sb.start(["echo", "hi"]).wait(30).stdout == b"hi\n"

        sleeper = sb.start(["sleep", "30"])
        sleeper.send_signal(sig.SIGTERM)
        assert sleeper.wait(30).exit_code in (143, -15), "ended by the signal"

        screen: list[bytes] = []
        term = sb.start(["sh"], pty=(24, 80), on_stdout=screen.append)
        term.resize(40, 120)
        term.write_stdin("stty size; exit 7\r")
        assert term.wait(30).exit_code == 7
        assert b"40 120" in b"".join(screen), b"".join(screen)[-500:]
        with pytest.raises(RuntimeShimError, match="needs a command started with pty"):
            sb.start(["true"]).resize(1, 1)

        sb.exec("mkdir -p /tmp/seen")
        watch = sb.watch("/tmp/seen")
        sb.write_file("/tmp/seen/f", b"x")
        events: list = []
        deadline = time.monotonic() + 20
        while ("create", "f") not in events:
            assert time.monotonic() < deadline, events
            events += [(e.kind, e.name) for e in watch.wait(1.0)]
        watch.close()
        assert watch.wait(0) == []
        with pytest.raises(NotADirectoryError):
            sb.watch("/tmp/seen/f")

        hung = sb.start(["sh", "-c", "echo $$ > /tmp/pid; exec sleep 300"])
        deadline = time.monotonic() + 20
        while sb.exec("cat /tmp/pid").exit_code != 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        pid = sb.read_file("/tmp/pid").decode().strip()
        hung.cancel()
        with pytest.raises(EnvbuildError):
            hung.wait(10)
        while sb.exec(["kill", "-0", pid]).exit_code == 0:  # the node killed it
            assert time.monotonic() < deadline, "a hung-up command ran on"
            time.sleep(0.1)
    finally:
        sb.close()


def test_the_async_handle_starts_commands_opens_ports_and_watches(cell):
    import asyncio

    from runtime_shim import PortRefused

    fleet = cell["fleet"]
    (sb,) = fleet.create(TEMPLATE, n=1, limits=_sized(), ttl=120)

    async def run() -> None:
        a = sb.aio()
        seen: list[bytes] = []
        proc = await a.start(["cat"], on_stdout=seen.append)
        proc.write_stdin(b"x" * 200_000)
        proc.close_stdin()
        r = await proc.wait()
        assert r.exit_code == 0 and r.stdout == b"x" * 200_000 == b"".join(seen)
        slow = await a.start("sleep 30")
        slow.kill()
        assert (await slow.wait()).exit_code in (137, -9)

        await a.write_file("/tmp/www/index.html", b"page")
        httpd = await a.start(["busybox", "httpd", "-f", "-p", "8080", "-h", "/tmp/www"])
        deadline = time.monotonic() + 20
        while True:
            try:
                sock = await a.connect_port(8080, 5.0)
                break
            except PortRefused:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"GET /index.html HTTP/1.0\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.") and answer.endswith(b"\r\n\r\npage"), answer
        with pytest.raises(PortRefused):
            await a.connect_port(8081, 5.0)
        await httpd.cancel()

        watch = await a.watch("/tmp/www")
        await a.write_file("/tmp/www/new", b"x")
        events = await asyncio.wait_for(watch.next_events(), 10)
        assert ("create", "new") in {(e.kind, e.name) for e in events}
        watch.close()
        assert await watch.next_events() == [] and watch.fileno() == -1
        with pytest.raises(FileNotFoundError):
            await a.watch("/tmp/nothing-here")
    try:
        asyncio.run(run())
    finally:
        sb.close()
