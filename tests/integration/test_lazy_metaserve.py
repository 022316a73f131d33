"""The lazy daemon's metadata server (``runtime_shim.lazyfs.metaserve``) over real passthrough
mounts served by the node daemon from a store directory: it answers a mount's lookups,
attributes and listings itself (the daemon's counters show it), forwards opens, so reads are
right; when it dies the daemon reads the mount's requests itself and nothing is lost; when the
daemon dies it follows. Off (the default, ``metaserve.wanted``), the daemon answers
everything."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from runtime_shim.isolation.mount import mounted_targets_under, unmount
from runtime_shim.lazyfs import lazy_stats
from runtime_shim.lazyfs.control import daemon_request
from tests.integration.test_lazy_dirs import NAMES
from tests.integration.test_lazy_dirs import _mounted as _dirs_mounted
from tests.integration.test_lazy_preload import _wait_for

pytestmark = pytest.mark.integration

LOOKUP = "1"


def _mounted(tmp_path, monkeypatch, **env):
    return _dirs_mounted(tmp_path, monkeypatch, **{"ENVBUILD_LAZY_METASERVER": "on", **env})


def _ping(node_root: Path) -> dict:
    reply = daemon_request(node_root, {"op": "ping"}, 5)
    assert reply is not None and reply["ok"], reply
    return reply


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_lookups_are_answered_by_the_metadata_server(tmp_path, monkeypatch):
    with _mounted(tmp_path, monkeypatch) as mp:
        server = _ping(tmp_path / "node")["metadata_server"]
        assert server is not None and server["alive"], server
        assert _alive(server["pid"]) and server["pid"] != lazy_stats(mp)["pid"]
        # the daemon reads the mount's first requests until the server has its tree
        assert _wait_for(lambda: lazy_stats(mp)["metadata_server"] is True)
        before = lazy_stats(mp)
        sizes = {name: os.lstat(mp / "unlisted" / name).st_size for name in NAMES}
        assert sizes == {name: i for i, name in enumerate(NAMES)}
        assert sorted(os.listdir(mp / "listed")) == sorted([*NAMES, "again.py", "sub"])
        after = lazy_stats(mp)
        # each name was one LOOKUP, answered (and counted) by the server, not the daemon
        assert after["metadata_server_requests"] - before["metadata_server_requests"] \
            >= len(NAMES)
        assert int(after["requests_by_opcode"][LOOKUP]) \
            - int(before["requests_by_opcode"].get(LOOKUP, 0)) >= len(NAMES)
        # opens go to the daemon (the file cache, the backing file): contents are right
        assert (mp / "listed" / "m07.py").read_bytes() == b"x" * 7
        assert os.stat(mp / "listed" / "again.py").st_ino \
            == os.stat(mp / "listed" / "m05.py").st_ino


def test_when_the_metadata_server_dies_the_daemon_serves_the_mount(tmp_path, monkeypatch):
    with _mounted(tmp_path, monkeypatch) as mp:
        assert (mp / "listed" / "m03.py").read_bytes() == b"xxx"
        assert _wait_for(lambda: lazy_stats(mp)["metadata_server"] is True)
        server = _ping(tmp_path / "node")["metadata_server"]
        os.kill(server["pid"], signal.SIGKILL)
        assert _wait_for(lambda: not _ping(tmp_path / "node")["metadata_server"]["alive"])
        # names never looked up before (the kernel must ask), opens, a listing: all answered
        sizes = {name: os.lstat(mp / "unlisted" / name).st_size for name in NAMES}
        assert sizes == {name: i for i, name in enumerate(NAMES)}
        assert (mp / "unlisted" / "m09.py").read_bytes() == b"x" * 9
        assert (mp / "listed" / "m03.py").read_bytes() == b"xxx"
        assert lazy_stats(mp)["metadata_server"] is False


def test_the_metadata_server_follows_its_daemon(tmp_path, monkeypatch):
    with _mounted(tmp_path, monkeypatch) as mp:
        assert _wait_for(lambda: lazy_stats(mp)["metadata_server"] is True)
        ping = _ping(tmp_path / "node")
        server = ping["metadata_server"]["pid"]
        os.kill(ping["pid"], signal.SIGKILL)
        try:
            # its control socket closed: the server exits, and the dead daemon's mount ends
            # with it (ENOTCONN) instead of answering lookups while every open hangs
            assert _wait_for(lambda: not _alive(server)), \
                "the metadata server outlived its daemon"
            with pytest.raises(OSError):
                os.statvfs(mp)
        finally:   # the stale mount (a new daemon would replace it: test_lazy_sandbox)
            if str(mp) in mounted_targets_under(str(mp)):
                unmount(mp)


def test_by_default_the_daemon_answers_everything(tmp_path, monkeypatch):
    monkeypatch.delenv("ENVBUILD_LAZY_METASERVER", raising=False)
    with _dirs_mounted(tmp_path, monkeypatch) as mp:
        assert _ping(tmp_path / "node")["metadata_server"] is None
        sizes = {name: os.lstat(mp / "unlisted" / name).st_size for name in NAMES}
        assert sizes == {name: i for i, name in enumerate(NAMES)}
        stats = lazy_stats(mp)
        assert stats["metadata_server"] is False and stats["metadata_server_requests"] == 0
        assert int(stats["requests_by_opcode"][LOOKUP]) >= len(NAMES)
