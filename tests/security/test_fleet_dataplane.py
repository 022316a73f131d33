"""The fleet's data plane (``runtime_shim.fleet.dataplane``) refuses what it must: a call
without its sandbox's token, with another sandbox's, with a guessed one, for a closed or
pooled sandbox, or malformed (oversize, not JSON, another version, a bad command) — all on a
real daemon's loopback listener (stub sandboxes: the checks are the daemon's)."""

from __future__ import annotations

import json
import socket
import struct

import pytest

from envbuild.errors import RuntimeShimError, SandboxNotFound
from runtime_shim.fleet import dataplane
from tests.fleet_stub import data_cell  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration


@pytest.fixture
def cell(data_cell):
    return data_cell


def _exec(sb, token: str | None, sdk_id: str | None = None):
    request = dataplane.exec_request(sdk_id or sb.sdk_id, token or "", "id", {})
    return dataplane.call(tuple(sb.record.data_addr), request, 5.0, sb.node_id)


def test_a_call_needs_its_own_sandboxs_token(cell):
    a, b = cell.fleet().create(cell.lock, n=2)
    assert _exec(a, a.record.token)["exit_code"] == 0
    for token, target in ((None, a), ("0" * 64, a), (b.record.token, a), (a.record.token, b),
                          (a.record.token[:-1], a)):
        with pytest.raises(SandboxNotFound):
            _exec(target, token)
    with pytest.raises(SandboxNotFound):  # an id that is not one: the same answer
        _exec(a, a.record.token, sdk_id="../../etc")


def test_a_closed_sandboxs_token_opens_nothing(cell):
    (sb,) = cell.fleet().create(cell.lock, n=1)
    token = sb.record.token
    sb.close()
    with pytest.raises(SandboxNotFound):
        _exec(sb, token)


def test_attach_hands_the_same_token_and_pooled_sandboxes_have_none(cell):
    fleet = cell.fleet()
    (sb,) = fleet.create(cell.lock, n=1)
    assert fleet.attach(sb.id).record.token == sb.record.token, "attach hands the same one"
    daemon = next(iter(cell.daemons.values()))
    fleet.warm(cell.lock, per_node=1, wait=30)
    pooled = [k for k, e in daemon._entries.items() if e.pool]
    assert pooled and all(daemon.data_token(k) is None for k in pooled)
    fleet.warm(cell.lock, per_node=0)


def test_connections_past_the_bound_are_closed_and_the_rest_served(cell, monkeypatch):
    monkeypatch.setattr(dataplane, "MAX_CONNECTIONS", 3)
    server = dataplane.DataServer("127.0.0.1", lambda request: {"echo": request.get("x")})
    try:
        idle = [socket.create_connection(server.address, timeout=5) for _ in range(3)]
        with socket.create_connection(server.address, timeout=5) as extra:
            assert extra.recv(1) == b"", "the fourth is closed at once"
        idle.pop().close()
        for _ in range(50):  # its thread ends, its slot comes back
            try:
                assert dataplane.call(server.address, {"x": 7}, 5.0, "0" * 12)["echo"] == 7
                break
            except dataplane.NodeLost:
                continue
        else:
            raise AssertionError("a freed slot was never served")
        for s in idle:
            s.close()
    finally:
        server.close()


def _raw(addr, payload: bytes) -> bytes:
    with socket.create_connection(tuple(addr), timeout=5) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        return s.recv(1 << 16)


def test_malformed_requests_end_the_connection_or_are_refused(cell):
    (sb,) = cell.fleet().create(cell.lock, n=1)
    addr = sb.record.data_addr
    assert _raw(addr, struct.pack(">I", dataplane.MAX_FRAME + 1)) == b"", "oversize: closed"
    assert _raw(addr, struct.pack(">I", 5) + b"{nope") == b"", "not JSON: closed"
    body = json.dumps({"v": 99, "op": "exec"}).encode()
    reply = _raw(addr, struct.pack(">I", len(body)) + body)
    assert b'"ok":false' in reply and b"version" in reply
    with pytest.raises(RuntimeShimError, match="string or a list"):
        dataplane.call(tuple(addr), {"op": "exec", "id": sb.sdk_id, "token": sb.record.token,
                                     "cmd": {"not": "a command"}}, 5.0, sb.node_id)
    with pytest.raises(RuntimeShimError, match="unknown data-plane request"):
        dataplane.call(tuple(addr), {"op": "rm", "id": sb.sdk_id, "token": sb.record.token},
                       5.0, sb.node_id)
    assert sb.exec("still works").stdout == b"still works"
