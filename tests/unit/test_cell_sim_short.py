"""``benchmarks/cell_sim.py`` in a short form (issue 39: the cell simulation runs in CI with a
small N, asserting only that it works: every create made, the figures printed, nothing left)."""

from __future__ import annotations

import importlib.util
import sys

from tests.conftest import REPO


def _cell_sim():
    spec = importlib.util.spec_from_file_location("cell_sim", REPO / "benchmarks" / "cell_sim.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("cell_sim", module)
    spec.loader.exec_module(module)
    return module


def test_cell_sim_runs_in_a_short_form(tmp_path, capsys):
    figures = _cell_sim().run(["--nodes", "4", "--rate", "100", "--seconds", "1", "--batch", "10",
                               "--threads", "2", "--ttl", "0.5", "--slots", "100",
                               "--root", str(tmp_path)])
    out = capsys.readouterr().out
    assert figures["errors"] == 0 and figures["made"] == 100, out
    assert figures["peak_live"] > 0 and figures["fit_placed"] == 400, out
    for line in ("kept up:", "driver CPU per create:", "node calls per create:",
                 "placement model:"):
        assert line in out
    assert figures["left"] == 0, "every simulated sandbox closed at the end"
