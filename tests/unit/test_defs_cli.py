"""``envbuild validate``: a summary line on success, one line per problem and exit 1 otherwise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from envbuild.cli.main import main

BASE = """\
apiVersion: envbuild/v1
kind: Base
name: b
abi: a
from: {scratch: {}}
"""
ENV = """\
apiVersion: envbuild/v1
kind: Env
name: e
base: b
"""


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ENVBUILD_DEFS", raising=False)
    (tmp_path / "envdefs/base").mkdir(parents=True)
    (tmp_path / "envdefs/envs").mkdir(parents=True)
    (tmp_path / "envdefs/base/b.yaml").write_text(BASE)
    (tmp_path / "envdefs/envs/e.yaml").write_text(ENV)
    return tmp_path / "envdefs"


def test_validate_ok_prints_a_summary(tree, capsys):
    assert main(["validate"]) == 0
    out = capsys.readouterr().out
    assert out == "ok: 2 definitions (1 base, 0 workspaces, 0 toolkits, 1 env) in envdefs\n"


def test_validate_takes_a_directory_argument(tree, capsys):
    tree.rename(tree.parent / "other")
    assert main(["validate", "other"]) == 0
    assert capsys.readouterr().out.endswith(" in other\n")


def test_validate_uses_the_defs_option(tree, capsys):
    tree.rename(tree.parent / "other")
    assert main(["--defs", "other", "validate"]) == 0


def test_validate_reports_one_line_per_problem_and_exits_1(tree, capsys):
    (tree / "envs/e.yaml").write_text(ENV + "toolkit: [x]\n")
    (tree / "base/b.yaml").write_text(BASE.replace("abi: a", "abi: A"))
    assert main(["validate"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "envdefs/base/b.yaml:4:6: abi: 'A' is not a valid abi contract (at abi) — an abi "
        "contract may contain lowercase letters, digits, '-', '.', '_' and starts with a letter "
        "or digit",
        "envdefs/envs/e.yaml:5:1: unknown key 'toolkit' (at toolkit) — did you mean 'toolkits'?",
        "error: 2 problems in definitions",
    ]
    assert "Traceback" not in captured.err


def test_validate_missing_directory_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "nowhere"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nowhere: definition directory: no such directory")


def test_validate_runs_the_graph_checks(tree, capsys):
    pytest.importorskip("envbuild.plan.graph")
    (tree / "envs/e.yaml").write_text(ENV.replace("base: b", "base: bb"))
    assert main(["validate"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("envdefs/envs/e.yaml:4:7: ")
    assert err[-1] == "error: 1 problem in definitions"


def test_validate_reports_schema_and_graph_problems_together(tree, capsys):
    """Issue 12, item 11: an unknown key in one document and a cycle between two others are
    reported in the same run, each as FILE:LINE:COL."""
    (tree / "envs/e.yaml").write_text(ENV + "colour: red\n")
    (tree / "base/b.yaml").write_text(BASE.replace("from: {scratch: {}}", "from: {base: c}"))
    (tree / "base/c.yaml").write_text(BASE.replace("name: b", "name: c")
                                      .replace("from: {scratch: {}}", "from: {base: b}"))
    assert main(["validate"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("envdefs/envs/e.yaml:5:1: ") and "colour" in line
               for line in lines), lines
    cycle = [line for line in lines if "cycle of definitions" in line]
    assert len(cycle) == 1 and re.match(r"envdefs/base/[bc]\.yaml:5:\d+: ", cycle[0]), lines
    assert lines[-1] == "error: 2 problems in definitions"


def test_a_reference_to_a_document_with_problems_is_not_also_called_missing(tree, capsys):
    (tree / "base/b.yaml").write_text(BASE + "colour: red\n")
    assert main(["validate"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert any("colour" in line for line in lines)
    assert not any("no Base with that name" in line for line in lines), lines
