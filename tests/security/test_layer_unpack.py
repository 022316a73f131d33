"""Issue 34 item 7, ``envbuild layer unpack`` of an untrusted layer onto the host: it made
setuid-root files and 0666 device nodes (a layer's ``/dev/sda`` is the host's disk). By
default now the setuid/setgid bits are cleared and a layer with a device node is refused with
one line before anything is written; ``--keep-setid`` / ``--allow-devices`` ask for them.
The real CLI in a subprocess, as root, on layers packed from real trees."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from tests.conftest import require_root

REPO = Path(__file__).parents[2]


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "ENVBUILD_STORE": str(cwd / "store")}
    return subprocess.run([sys.executable, "-m", "envbuild.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _layer(tmp_path: Path, *, device: bool) -> Path:
    require_root()
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    tool = src / "bin" / "su-like"
    tool.write_text("#!/bin/sh\nid\n")
    os.chown(tool, 0, 0)
    os.chmod(tool, 0o6755)  # setuid and setgid root
    if device:
        (src / "dev").mkdir()
        os.mknod(src / "dev" / "sda", stat.S_IFBLK | 0o666, os.makedev(8, 0))
    r = _cli("layer", "pack", "src", "-o", "layer.tzst", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return tmp_path / "layer.tzst"


def test_setid_bits_are_cleared_unless_asked_for(tmp_path):
    _layer(tmp_path, device=False)
    r = _cli("layer", "unpack", "layer.tzst", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    st = os.stat(tmp_path / "out" / "bin" / "su-like")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)  # was 0o6755
    r = _cli("layer", "unpack", "--keep-setid", "layer.tzst", "kept", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(tmp_path / "kept" / "bin" / "su-like").st_mode) == 0o6755


def test_a_layer_with_a_device_node_is_refused_unless_asked_for(tmp_path):
    _layer(tmp_path, device=True)
    r = _cli("layer", "unpack", "layer.tzst", "out", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: ")
    assert "dev/sda is a block node, refused" in lines[0] and "--allow-devices" in lines[1]
    assert not (tmp_path / "out").exists()  # nothing written
    r = _cli("layer", "unpack", "--allow-devices", "layer.tzst", "dev-ok", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    st = os.stat(tmp_path / "dev-ok" / "dev" / "sda")
    assert stat.S_ISBLK(st.st_mode) and st.st_rdev == os.makedev(8, 0)
