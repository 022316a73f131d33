"""A Dockerfile's ``RUN`` steps write only to the layer's capped disk (issue 34, item 4).

Observed before: ``RUN dd if=/dev/zero of=/x bs=1M count=3072`` grew the host's used disk by
3 GB, because the private dockerd's data root (where BuildKit keeps what ``RUN`` writes) was a
plain directory of the node cache. Now the data root is on the build's scratch disk
(``runtime_shim.isolation.scratchfs``, ``ENVBUILD_BUILD_DISK``): the step meets ``ENOSPC`` at the cap.

The node cache lives on a filesystem of the test's own (an ext4 image), so "the host's used
disk" is measured there, unaffected by whatever else runs on the machine.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from runtime_shim.isolation import scratchfs
from tests.integration.test_dockerfile_base import _assert_daemon_gone, _error, _ours, _require_docker

CAP_MIB = 64
WRITE_MIB = 4 * CAP_MIB
SLACK_MIB = 16  # the node cache's own files: scratchfs templates, the daemon's log and state

BASE = """\
apiVersion: envbuild/v1
kind: Base
name: hostile
abi: hostile-1
from:
  dockerfile:
    context: ctx
"""


@pytest.fixture
def host_fs(tmp_path):
    """A 1 GiB ext4 of the test's own, standing in for the host's filesystem."""
    (tmp_path / "hostfs").mkdir()
    mount = scratchfs.create(tmp_path / "hostfs", 1 << 30, None,
                             template_root=tmp_path / "templates", nodev_nosuid=False)
    try:
        yield mount
    finally:
        scratchfs.destroy(tmp_path / "hostfs")


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class _Peak:
    """The highest used-bytes figure of a filesystem, sampled every 20 ms."""

    def __init__(self, path: Path) -> None:
        self.path, self.peak, self.stop = path, _used(path), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, _used(self.path))

    def __enter__(self) -> _Peak:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _used(self.path))


def test_a_dockerfile_run_writing_past_the_cap_fails_and_the_host_disk_does_not_grow(
        envbuild_cli, host_fs, monkeypatch):
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setenv("ENVBUILD_BUILD_DISK", f"{CAP_MIB}M")
    envbuild_cli.node = host_fs / "node-cache"
    ctx = envbuild_cli.defs / "base" / "ctx"
    ctx.mkdir(parents=True)
    shutil.copy2("/bin/busybox", ctx / "busybox")
    (ctx / "Dockerfile").write_text(
        "FROM scratch\nCOPY busybox /bin/busybox\n"
        f"RUN [\"/bin/busybox\", \"dd\", \"if=/dev/zero\", \"of=/x\", \"bs=1M\", "
        f"\"count={WRITE_MIB}\"]\n")
    (envbuild_cli.defs / "base" / "hostile.yaml").write_text(BASE)
    before_traces = _ours()
    baseline = _used(host_fs)
    with _Peak(host_fs) as peak:
        r = envbuild_cli("build", "hostile")
    grew_mib = (peak.peak - baseline) / (1 << 20)
    assert grew_mib < CAP_MIB + SLACK_MIB, f"the host's used disk grew by {grew_mib:.0f} MiB"
    assert r.code == 1, r.err
    first = _error(r.err)
    assert "hostile: docker build failed" in first, r.err
    assert f"out of space: the layer's disk limit is {CAP_MIB} MiB" in first, r.err
    keys = Path(envbuild_cli.store) / "keys"
    assert not keys.exists() or not any(p.is_file() for p in keys.rglob("*")), "published"
    _assert_daemon_gone(envbuild_cli.node, before_traces)
    assert _used(host_fs) - baseline < (SLACK_MIB << 20), "the build left data on the host"
