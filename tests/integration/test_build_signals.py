"""SIGTERM / Ctrl-C during ``envbuild build``: exit promptly, leave nothing behind, rerun works.

The interrupted layer is a toolkit whose step sleeps for 30 s while ``/etc/slow`` exists in its
base. After the interrupt the test rewrites the base without that file (same abi): the base
rebuilds, the toolkit keeps its key (the O(m) rule), and the rerun builds that very key in a
second — proving the interrupted key left no lock, record or state that blocks it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from envbuild.store import LocalStore, get_key_record
from runtime_shim.isolation.runc import OciRuntime, list_containers
from tests.conftest import require_tool

SLOW = "slow-tk"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def write_tree(defs: Path, *, slow: bool) -> None:
    marker = "touch /etc/slow" if slow else "rm -f /etc/slow"
    _write(defs / "base" / "bb.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Base
        name: bb
        abi: bb-signals
        from: {{busybox: {{binary: /bin/busybox}}}}
        steps:
          - run: mkdir -p /etc /tmp && {marker}
            network: none
        config:
          env: {{PATH: /usr/sbin:/usr/bin:/sbin:/bin}}
        """)
    _write(defs / "toolkits" / f"{SLOW}.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Toolkit
        name: {SLOW}
        build_on: bb
        prefix: /opt/toolkits/{SLOW}
        steps:
          - run: |
              if [ -e /etc/slow ]; then sleep 30; fi
              mkdir -p /opt/toolkits/{SLOW}/bin
            network: none
        """)


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(path))]


def _blobs(store: Path) -> set[str]:
    return {p.name for p in (store / "blobs" / "sha256").iterdir()}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_interrupted_build_cleans_up_and_reruns(envbuild_cli, tmp_path, signum):
    runc = require_tool("runc")
    defs = tmp_path / "sig" / "envdefs"
    write_tree(defs, slow=True)
    assert envbuild_cli("build", "bb", defs=defs).code == 0
    key = {lay["name"]: lay["key"]
           for lay in envbuild_cli("plan", "--json", defs=defs).json()["layers"]}[SLOW]
    store = LocalStore(envbuild_cli.store)
    blobs_before = _blobs(envbuild_cli.store)
    state = OciRuntime("runc", state_root=str(envbuild_cli.node / "runc"))

    env = {"ENVBUILD_NODE_CACHE": str(envbuild_cli.node), "ENVBUILD_STORE": str(envbuild_cli.store),
           "ENVBUILD_DEFS": str(defs), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    log = tmp_path / "build.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "envbuild.cli", "build", SLOW],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not any(c.get("status") == "running" for c in list_containers(state)):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the slow step never started: " + log.read_text()
            time.sleep(0.05)
        assert _mounts_under(envbuild_cli.node), "the step runs over an overlay in the node dir"
        sent = time.monotonic()
        proc.send_signal(signum)
        code = proc.wait(timeout=15)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text()
    assert code != 0, output
    assert took < 5, f"exit took {took:.1f}s after the signal"
    assert "Traceback" not in output, output

    assert list_containers(state, prefix="") == []
    listed = subprocess.run([runc, "--root", state.state_root, "list", "-q"],
                            capture_output=True, text=True, check=True)
    assert listed.stdout.strip() == ""
    assert _mounts_under(envbuild_cli.node) == []
    assert get_key_record(store, key) is None
    assert _blobs(envbuild_cli.store) == blobs_before
    scratch = envbuild_cli.node / "builds"
    assert not scratch.exists() or list(scratch.iterdir()) == []

    write_tree(defs, slow=False)  # same abi: the toolkit's key does not change
    rerun = envbuild_cli("build", "--json", defs=defs)
    assert rerun.code == 0, rerun.err
    layers = {lay["name"]: lay for lay in rerun.json()["layers"]}
    assert layers[SLOW]["key"] == key and layers[SLOW]["status"] == "built"
    assert layers["bb"]["status"] == "built"
    assert get_key_record(store, key) is not None
    assert list_containers(state, prefix="") == []
    assert _mounts_under(envbuild_cli.node) == []
