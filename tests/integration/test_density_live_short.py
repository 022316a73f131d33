"""``benchmarks/density_live.py`` in a short form (issue 39: the benchmark runs in CI with a
small N, asserting only that it works and leaves nothing)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, require_root, require_tool

pytestmark = pytest.mark.integration


def test_density_live_runs_in_a_short_form(tmp_path):
    require_root()
    require_tool("runc")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "density_live.py"), "--max", "12",
                        "--step", "6", "--probe", "3", "--root", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert [int(row[0]) for row in rows] == [6, 12], r.stdout
    assert "close:" in r.stdout
    assert not list((tmp_path / "node" / "sandboxes").iterdir())
