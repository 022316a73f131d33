"""``benchmarks/e2b_api.py`` in a short form (issue 37, Performance): the benchmark runs with
small numbers, asserting only that it works, prints its ratios and leaves nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.integration.conftest import build_busybox_env

pytestmark = pytest.mark.slow


def test_e2b_api_benchmark_runs_in_a_short_form(tmp_path):
    store, _ = build_busybox_env(tmp_path)
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "e2b_api.py"), "--store",
                        str(store.root), "--runs", "2", "--execs", "10", "--concurrent", "4",
                        "--mib", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    for figure in ("lifecycle create→run(true)→kill p50", "commands.run round trip p50",
                   "4 concurrent async creates: 0 errors", "files write+read 1 MiB (e2b):",
                   "files write+read 1 MiB (e2b-octet):", "e2b client CPU", "load average"):
        assert figure in out, out
    assert out.count(", ratio ") == 3, out  # lifecycle, files (default and octet-stream)
    assert out.count("caps the ratio at") == 2, out
