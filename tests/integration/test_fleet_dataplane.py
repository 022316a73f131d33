"""The fleet's data plane (``runtime_shim.fleet.dataplane``) on real daemons with stub
sandboxes and a real loopback listener: exec and files go over it, not through the control
calls; without it, or when it cannot be reached, they go through the calls as before (and
its streams are refused in one line)."""

from __future__ import annotations

import pytest

from envbuild.errors import ExecTimeout, RuntimeShimError
from tests.fleet_stub import stub_cell

pytestmark = pytest.mark.integration


@pytest.fixture
def direct(tmp_path):
    cell = stub_cell(tmp_path, nodes=2, data_host="127.0.0.1")
    yield cell
    cell.close()


def test_exec_and_files_go_over_the_data_plane(direct):
    fleet = direct.fleet()
    sb, other = fleet.create(direct.lock, n=2)
    assert sb.record.token and sb.record.data_addr[0] == "127.0.0.1"
    before = dict(direct.calls.counts)
    r = sb.exec(["echo", "hi"], stdin=b"+in", env={"A": "1"}, timeout=5)
    assert (r.exit_code, r.stdout) == (0, b"echo hi+in")
    assert r.stderr == repr(["env", "stdin", "timeout"]).encode(), "only the exec's kwargs"
    sb.write_file("/f", "data")
    assert sb.read_file("/f") == b"data"
    other.write_file("/f", b"other's")
    assert sb.read_file("/f") == b"data", "each sandbox its own files"
    assert direct.calls.counts == before, "no control call for exec or files"


def test_records_in_lists_carry_no_token(direct):
    fleet = direct.fleet()
    fleet.create(direct.lock, n=2)
    assert all(r.token is None and r.data_addr is None for r in fleet.list())
    assert "token" not in repr(fleet.create(direct.lock, n=1)[0].record)


def test_check_timeout_is_kept_on_the_client(direct, monkeypatch):
    from runtime_shim.node.model import ExecResult
    from tests.fleet_stub import StubSandbox

    monkeypatch.setattr(StubSandbox, "exec", lambda self, cmd, **kw: ExecResult(
        exit_code=124, stdout=b"so far", stderr=b"", duration=1.0, timed_out=True))
    (sb,) = direct.fleet().create(direct.lock, n=1)
    assert sb.exec("sleep 9", timeout=1).timed_out
    with pytest.raises(ExecTimeout) as e:
        sb.exec("sleep 9", timeout=1, check_timeout=True)
    assert e.value.result.stdout == b"so far"


def test_without_a_data_plane_exec_goes_through_the_calls(tmp_path):
    cell = stub_cell(tmp_path, nodes=1)
    try:
        (sb,) = cell.fleet().create(cell.lock, n=1)
        assert sb.record.token is None
        assert sb.exec("true").stdout == b"true"
        assert cell.calls.counts.get("exec") == 1
        for stream in (lambda: sb.start(["true"]), lambda: sb.connect_port(80),
                       lambda: sb.watch("/tmp")):  # streams need the data plane: one line
            with pytest.raises(RuntimeShimError, match="needs the nodes' data plane") as e:
                stream()
            assert "--data-host" in (e.value.hint or "")
    finally:
        cell.close()


def test_an_unreachable_data_plane_falls_back_to_the_calls(direct):
    import dataclasses

    (sb,) = direct.fleet().create(direct.lock, n=1)
    sb.record = dataclasses.replace(sb.record, data_addr=("127.0.0.1", 1))  # nothing listens
    assert sb.exec("true").stdout == b"true"
    assert direct.calls.counts.get("exec") == 1
