"""``envbuild.dockerd``, the throwaway Docker daemon other code reuses: it starts, answers,
and leaves nothing when the block ends (also by an exception), and an orphan left by a
SIGKILLed owner is removed by the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envbuild.dockerd import docker_daemon, mounts_under, sweep_stale_daemons
from tests.integration.test_dockerfile_base import _ours, _require_docker

pytestmark = pytest.mark.integration


def _naming(root: Path) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.fsencode(str(root)) in Path(f"/proc/{name}/cmdline").read_bytes():
                    out.append(int(name))
            except OSError:
                pass
    return out


def _assert_clean(root: Path, before: set[str]) -> None:
    assert not _naming(root)
    assert not mounts_under((root,))
    assert not any(root.iterdir()), list(root.iterdir())
    assert _ours() <= before


def test_private_daemon_answers_and_leaves_nothing_also_on_an_exception(tmp_path, monkeypatch):
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    root = tmp_path / "d"
    before = _ours()
    with pytest.raises(RuntimeError, match="inside"):
        with docker_daemon(root) as d:
            assert d.private and d.host.startswith("unix://")
            p = subprocess.run([d.cli, "info", "--format", "{{.Driver}} {{.ServerVersion}}"],
                               env=d.env(), capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, p.stderr
            assert "tcp://" not in " ".join(Path(f"/proc/{_naming(root)[0]}/cmdline")
                                            .read_bytes().decode().split("\0"))
            assert _naming(root), "dockerd and its containerd run from the daemon's dirs"
            raise RuntimeError("inside")
    _assert_clean(root, before)


@pytest.mark.parametrize("elsewhere", [False, True])
def test_an_orphan_of_a_killed_owner_is_swept(tmp_path, monkeypatch, elsewhere):
    """``elsewhere``: its data root on another directory (a build's capped disk, issue 34
    item 4), which the sweep finds through the daemon's record and removes too."""
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    root = tmp_path / "d"
    data = tmp_path / "build-disk" / "daemon-data"
    before = _ours()
    code = ("import sys, time; from pathlib import Path; from envbuild.dockerd import docker_daemon\n"
            "data = Path(sys.argv[2]) if len(sys.argv) > 2 else None\n"
            "with docker_daemon(Path(sys.argv[1]), data_root=data):\n"
            "    print('up', flush=True); time.sleep(300)\n")
    owner = subprocess.Popen([sys.executable, "-c", code, str(root),
                              *([str(data)] if elsewhere else [])], stdout=subprocess.PIPE,
                             text=True, env={k: v for k, v in os.environ.items()
                                             if k != "DOCKER_HOST"})
    try:
        assert owner.stdout.readline().strip() == "up"
        if elsewhere:
            assert any(data.iterdir()), "the daemon stores nothing in its data root"
            (top,) = [p for p in root.iterdir() if p.is_dir()]
            assert not (top / "data").exists()
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        time.sleep(0.5)
        assert _naming(root), "the orphaned dockerd keeps running after its owner died"
        removed = sweep_stale_daemons(root)
        assert len(removed) == 1
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    _assert_clean(root, before)
    assert not data.exists() and not _naming(data) and not mounts_under((data,))
