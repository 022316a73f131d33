"""``sandbox gc`` removes the empty sandbox cgroups a crash left (a runtime killed mid-create,
a host crash), on the real cgroup hierarchies: only empty ones, only old ones, never one a
process still runs in. The test's cgroups carry their own prefix so a sweep here
never looks at another test's sandboxes."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from runtime_shim.isolation import cgroupfs
from runtime_shim.node.layout import NodeLayout
from runtime_shim.sdk import sweep
from tests.conftest import require_root

pytestmark = pytest.mark.integration


def _hierarchies() -> list[Path]:
    return [h / cgroupfs.PARENT for h in cgroupfs.hierarchies()]


@pytest.fixture
def prefix(monkeypatch):
    require_root()
    tag = f"eb-gctest{uuid.uuid4().hex[:6]}-"
    monkeypatch.setattr(sweep, "STALE_CGROUP_PREFIX", tag)
    yield tag
    for parent in _hierarchies():   # whatever a failed test left
        for d in parent.glob(tag + "*") if parent.is_dir() else ():
            for pid in (d / "cgroup.procs").read_text().split():
                os.kill(int(pid), 9)
            d.rmdir()


def _make(sid: str) -> list[Path]:
    made = []
    for parent in _hierarchies():
        parent.mkdir(exist_ok=True)
        (parent / sid).mkdir()
        made.append(parent / sid)
    return made


def test_gc_removes_old_empty_cgroups_and_keeps_busy_ones(
        tmp_path, prefix, monkeypatch):
    monkeypatch.setattr(sweep, "STALE_CGROUP_AGE", 0.0)
    empty, busy = prefix + "empty", prefix + "busy"
    for sid in (empty, busy):
        _make(sid)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        pids_dir = cgroupfs.controller_dir("pids", busy) or cgroupfs.controller_dir("memory", busy)
        assert pids_dir is not None
        (pids_dir[0] / "cgroup.procs").write_text(str(sleeper.pid))
        done = sweep.sweep_sandboxes(NodeLayout(tmp_path / "node"))

        removed = {r.id for r in done if r.removed and r.reason == "stale cgroup"}
        assert empty in removed
        assert cgroupfs.dirs(empty) == []
        assert busy not in removed and cgroupfs.dirs(busy), "a cgroup with a process went"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_gc_leaves_a_young_empty_cgroup(tmp_path, prefix):
    young = prefix + "young"
    _make(young)   # STALE_CGROUP_AGE (minutes): a create in progress looks like this
    done = sweep.sweep_sandboxes(NodeLayout(tmp_path / "node"))
    assert young not in {r.id for r in done}
    assert cgroupfs.dirs(young)
