"""Issue 39, item 3: the host's file table is overcommitted, and guarded by what is open.

Reserving every sandbox's worst case of open files (``pids × nofile``, which no cgroup bounds)
held about seven default sandboxes on a 24 GiB host. A sandbox is now charged its worst case
divided by ``ENVBUILD_FILES_OVERCOMMIT`` (64 by default), and no sandbox is admitted while the
files the whole host really has open (``fs.file-nr``) would pass the budget
(``runtime_shim.node.admission``). Real runc sandboxes of the busybox env.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from envbuild.errors import AdmissionRefused
from runtime_shim.node.admission import sandbox_key
from runtime_shim.node.ledger import Ledger
from runtime_shim.sdk.sandbox import Limits, Sandbox

ENV = "env/busybox-shell"
MiB = 1 << 20
#: worst case 32 x 512 = 16,384 open files (32 pids: room for the 14 openers below and their
#: seq and sh)
OPENER = Limits(pids=32, nofile=512, memory_bytes=64 * MiB, disk_bytes=None)


def _create(store, node: Path) -> Sandbox:
    return Sandbox.create(ENV, store=store, node_dir=node, limits=OPENER)


def _files_open() -> int:
    return int(Path("/proc/sys/fs/file-nr").read_text().split()[0])


def test_sandboxes_past_the_strict_worst_case_are_admitted_by_default(
        busybox_store, tmp_path, monkeypatch):
    """A budget of 8,000 files holds not one of these sandboxes strictly (16,384 each); by
    default each is charged 16,384 / 64 = 256, so five fit, and strict mode still refuses."""
    store, _ = busybox_store
    node = tmp_path / "node"
    monkeypatch.delenv("ENVBUILD_FILES_OVERCOMMIT", raising=False)
    monkeypatch.setenv("ENVBUILD_NODE_BUDGET", "files=8000")
    made: list[Sandbox] = []
    try:
        for _ in range(5):
            made.append(_create(store, node))
        reserved = Ledger(node / "node").reserved()
        assert {reserved[sandbox_key(sb.id)].files for sb in made} == {256}
        assert made[-1].exec("ulimit -n").stdout == b"512\n"  # the limit itself is unchanged
        monkeypatch.setenv("ENVBUILD_FILES_OVERCOMMIT", "1")
        with pytest.raises(AdmissionRefused, match="node budget of open files exceeded"):
            made.append(_create(store, node))
    finally:
        for sb in made:
            sb.close()


def test_no_sandbox_is_admitted_while_the_host_really_has_its_files_open(
        busybox_store, tmp_path, monkeypatch):
    """The budget is made what the host has open now plus 4,000 (``ENVBUILD_HOST_RESERVE``);
    one sandbox opens 7,000 files (14 processes x 500, within its limits): the next create is
    refused in one line naming ``fs.file-nr``, and admitted again once they are closed."""
    store, _ = busybox_store
    node = tmp_path / "node"
    monkeypatch.delenv("ENVBUILD_FILES_OVERCOMMIT", raising=False)
    file_max = int(Path("/proc/sys/fs/file-max").read_text())
    keep = (_files_open() + 4000) / file_max
    monkeypatch.setenv("ENVBUILD_HOST_RESERVE", f"{(1 - keep) * 100:.6f}%")
    opener = _create(store, node)
    made = [opener]
    try:
        before = _files_open()
        opener.exec("for j in $(seq 14); do (for i in $(seq 3 502); do eval \"exec $i</dev/null\";"
                    " done; exec sleep 600) >/dev/null 2>&1 & done; sleep 1")
        assert _files_open() - before > 5000, "the sandbox did not open its files"
        with pytest.raises(AdmissionRefused) as e:
            made.append(_create(store, node))
        line = e.value.message
        assert line.startswith("node budget of open files exceeded: sandbox eb-"), line
        assert "open now (fs.file-nr)" in line and "of fs.file-max" in line
        assert "fs.file-nr" in e.value.hint and "\n" not in line
        opener.close()
        made.append(_create(store, node))
        assert made[-1].exec("echo ok").stdout == b"ok\n"
    finally:
        for sb in made:
            sb.close()
