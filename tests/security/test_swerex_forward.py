"""``EnvbuildDeployment``'s way in (issue 37 item 6): the loopback forward to swerex-remote in a
sandbox and its token. Real sandboxes of the ``py-swerex`` env (``tests/swerex_env.py``), the
real server, raw sockets and SWE-ReX's own client.

- the forward listens on ``127.0.0.1`` only (the kernel's socket table says so) and the
  sandbox has no network of its own;
- another local user's connection is closed unread, even with the right token;
- the token is random per deployment: none, a wrong one or another deployment's is refused
  (401) and the request does nothing; it is on no command line and in no session's
  environment;
- the forward relays at most ``max_connections`` connections at once;
- ``stop`` closes the forward (its live connections too) and the sandbox.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import pytest
import requests
from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

from envbuild.harness.swerex import EnvbuildDeployment
from runtime_shim import list_sandboxes
from tests.py_env import PyTree
from tests.swerex_env import ENV

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tree(swerex_tree) -> PyTree:
    return swerex_tree


def started(tree: PyTree, **kwargs) -> EnvbuildDeployment:
    d = EnvbuildDeployment(lock=f"env/{ENV}", store=str(tree.store_dir), node_dir=str(tree.node),
                           **kwargs)
    asyncio.run(d.start())
    return d


def token_of(d: EnvbuildDeployment) -> str:
    return d.runtime._config.auth_token


def listeners(port: int) -> list[str]:
    """The local addresses of the host's listening TCP sockets on ``port`` (hex, as
    ``/proc/net/tcp{,6}`` write them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.append(local.rsplit(":", 1)[0])
    return found


def test_the_forward_answers_on_the_loopback_only(tree):
    d = started(tree)
    try:
        assert d.forward.address == ("127.0.0.1", d.forward.port)
        assert listeners(d.forward.port) == ["0100007F"]  # 127.0.0.1, nothing else
        devices = d.sandbox.exec(["cat", "/proc/net/dev"]).stdout.decode().splitlines()[2:]
        assert [line.split(":")[0].strip() for line in devices] == ["lo"]
    finally:
        asyncio.run(d.stop())


#: Another local user's client: the right token, a raw request; prints what comes back.
OTHER_USER_CLIENT = """\
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
try:
    s.sendall(b"GET /is_alive HTTP/1.0\\r\\nX-API-Key: " + sys.argv[2].encode() + b"\\r\\n\\r\\n")
    print(repr(s.recv(4096)))
except ConnectionResetError:
    print("reset")
"""


def test_another_users_connection_is_closed_even_with_the_token(tree):
    d = started(tree)
    try:
        out = subprocess.run(["/usr/bin/python3", "-I", "-c", OTHER_USER_CLIENT,
                              str(d.forward.port), token_of(d)], user=65534, group=65534,
                             capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.strip() in ("b''", "reset")
        assert asyncio.run(d.is_alive()).is_alive  # this user's client is served
    finally:
        asyncio.run(d.stop())


def test_the_token_is_random_per_deployment_and_required(tree):
    a, b = started(tree), started(tree)
    try:
        ta, tb = token_of(a), token_of(b)
        assert ta != tb and len(ta) >= 43 and len(tb) >= 43  # 32 random bytes each
        url = f"http://127.0.0.1:{a.forward.port}"
        body = {"command": "touch /tmp/pwned", "shell": True}
        for headers in ({}, {"X-API-Key": ""}, {"X-API-Key": "wrong"}, {"X-API-Key": tb}):
            assert requests.get(f"{url}/is_alive", headers=headers, timeout=10).status_code == 401
            r = requests.post(f"{url}/execute", json=body, headers=headers, timeout=10)
            assert r.status_code == 401
        assert a.sandbox.exec(["sh", "-c", "test -e /tmp/pwned"]).exit_code == 1
        ok = requests.get(f"{url}/is_alive", headers={"X-API-Key": ta}, timeout=10)
        assert ok.status_code == 200 and ok.json()["is_alive"] is True
    finally:
        asyncio.run(a.stop())
        asyncio.run(b.stop())


def test_the_token_is_on_no_command_line_and_in_no_session(tree):
    d = started(tree)
    try:
        token = token_of(d).encode()
        cmdlines = d.sandbox.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline"]).stdout
        assert b"uvicorn" in cmdlines and token not in cmdlines  # the server's is there
        r = d.runtime
        asyncio.run(r.create_session(CreateBashSessionRequest()))
        env = asyncio.run(r.run_in_session(BashAction(command="env", check="raise"))).output
        assert "PATH=" in env and token.decode() not in env
    finally:
        asyncio.run(d.stop())


def test_the_forward_relays_a_bounded_number_of_connections(tree):
    d = started(tree, max_connections=2)
    try:
        # start's own is_alive probes go through the forward: a probe's relay lives on until
        # the server closes its end, and on a loaded host it still held a slot when the first
        # connection below came, so the second was refused as one too many
        deadline = time.monotonic() + 10
        while d.forward.active > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert d.forward.active == 0
        held = [socket.create_connection(d.forward.address, timeout=10) for _ in range(2)]
        deadline = time.monotonic() + 10
        while d.forward.active < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert d.forward.active == 2
        with socket.create_connection(d.forward.address, timeout=10) as extra:
            assert extra.recv(1) == b""  # closed at once, unread
        held.pop().close()
        deadline = time.monotonic() + 10
        while d.forward.active > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert asyncio.run(d.is_alive()).is_alive  # a free slot serves again
        for sock in held:
            sock.close()
    finally:
        asyncio.run(d.stop())


def test_stop_closes_the_forward_its_connections_and_the_sandbox(tree):
    d = started(tree)
    port, sid = d.forward.port, d.sandbox_id
    live = socket.create_connection(("127.0.0.1", port), timeout=10)
    live.sendall(b"GET /is_alive HTTP/1.1\r\nHost: x\r\n")  # an unfinished request
    asyncio.run(d.stop())
    assert live.recv(1) == b""  # the relayed connection ended with the deployment
    live.close()
    assert listeners(port) == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert sid not in {info.id for info in list_sandboxes(tree.node)}
