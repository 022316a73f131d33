"""The short form of ``benchmarks/soak.py`` (issue 34): one phase of sandbox lifecycles — full
and native lazy containers, FnCall calls, one microVM — beside a hostile tenant while faults
are injected at random (SIGKILL of a creating process, of runc, of the lazy filler's worker;
the store gone for seconds; the node's disk nearly full). Every result is right or an error, never wrong, and
the node is left with nothing of the soak: the benchmark's own checks, run for real."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import require_root, require_tool

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def _soak():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("soak", REPO / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_short_soak_has_no_wrong_result_and_leaves_nothing(tmp_path, capsys):
    require_root()
    for tool in ("runc", "busybox", "mkfs.ext4", "fallocate", "qemu-system-x86_64"):
        require_tool(tool)
    code = _soak().main(["--phases", "1", "--lifecycles", "12", "--workers", "3", "--vms", "1",
                         "--seed", "34", "--store", str(tmp_path / "store"), "--json"])
    out = capsys.readouterr().out
    import json

    total = json.loads(out.strip().splitlines()[-1])
    phase = total["phases"][0]
    assert total["wrong"] == 0, phase["wrong_examples"]
    assert total["leaks"] == 0, phase["leaks"]
    assert phase["ok"] >= 3, phase              # the soak did real work, not only errors
    assert total["faults"] >= 1, phase          # and faults were injected into it
    assert code == 0
