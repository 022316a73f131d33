"""Exec logs (``runtime_shim.fleet.execlog``) round-trip through a store, replay in order,
refuse unknown versions, and a fast-forward answers only the matching prefix."""

from __future__ import annotations

import pytest

from envbuild.errors import RuntimeShimError, UnsupportedFormatError
from envbuild.store import MemoryStore
from runtime_shim.fleet import execlog
from runtime_shim.node.model import ExecResult


def _result(code: int, out: bytes) -> ExecResult:
    return ExecResult(exit_code=code, stdout=out, stderr=b"", duration=0.01)


def _log(store) -> None:
    execlog.start(store, "eb-0123456789ab", lock="sha256:" + "1" * 64, node_id="n1")
    execlog.append(store, "eb-0123456789ab", 1, "write", path="/a", data=b"x" * 10, mode=0o600)
    execlog.append(store, "eb-0123456789ab", 2, "exec", cmd="cat /a",
                   kwargs={"env": {"K": "v"}}, result=_result(0, b"x" * 10))
    execlog.append(store, "eb-0123456789ab", 3, "exec", cmd=["ls", "/"], kwargs={},
                   result=_result(1, b"big" * (execlog.MAX_INLINE // 2)))
    execlog.append(store, "eb-0123456789ab", 4, "write", path="/b",
                   data=b"y" * (execlog.MAX_INLINE + 1), mode=0o644)


def test_round_trip_and_replay_in_order():
    store = MemoryStore()
    _log(store)
    log = execlog.read(store, "eb-0123456789ab")
    assert [e.seq for e in log.entries] == [1, 2, 3, 4]
    assert log.entries[1].result == _result(0, b"x" * 10)
    assert log.entries[2].result is None, "a cut output is never handed back"
    assert log.entries[3].data == b"y" * (execlog.MAX_INLINE + 1)  # through a blob
    calls: list = []
    report = execlog.replay_ops(log, lambda cmd, kw: calls.append(("exec", cmd, kw)) or
                                _result(0, b"changed"),
                                lambda p, d, m: calls.append(("write", p, len(d), m)))
    assert [c[0] for c in calls] == ["write", "exec", "exec", "write"]
    assert calls[1] == ("exec", "cat /a", {"env": {"K": "v"}})
    assert report.ran == 4 and report.differed == (2,)
    assert execlog.replay_ops(log, lambda c, k: _result(0, b""), lambda *a: None,
                              upto=1).ran == 1


def test_matching_is_exact():
    store = MemoryStore()
    _log(store)
    entry = execlog.read(store, "eb-0123456789ab").entries[1]
    assert entry.matches_exec("cat /a", {"env": {"K": "v"}})
    assert not entry.matches_exec("cat /a", {})
    assert not entry.matches_exec(["cat", "/a"], {"env": {"K": "v"}})


def test_missing_log_and_unknown_versions_are_refused():
    store = MemoryStore()
    with pytest.raises(RuntimeShimError, match="no exec log"):
        execlog.read(store, "eb-ffffffffffff")
    store.put_record("execlog/v1/eb-ffffffffffff", "meta", {"version": 99})
    with pytest.raises(UnsupportedFormatError, match="version 99"):
        execlog.read(store, "eb-ffffffffffff")
