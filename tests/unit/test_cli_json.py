"""``--json`` on the CLI (``envbuild.cli.output``, ``docs/cli-json.md``): one printer, one
document on stdout; errors stay one line on stderr with exit 1. What needs a real sandbox or
node is in ``tests/integration/test_cli_json.py``."""

from __future__ import annotations

import json

import click
import pytest

from envbuild.cli import main as cli_main
from envbuild.cli.main import main
from envbuild.cli.output import dumps_lines, remove_each
from envbuild.errors import RuntimeShimError

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

#: Every command that lists or reports, by its path: each takes --json.
REPORTING = [
    ("validate",), ("graph",), ("plan",), ("explain",), ("build",), ("lock",), ("check",),
    ("pack-diff",), ("squash",), ("export",), ("push",), ("pull",), ("gc",),
    ("sandbox", "ls"), ("sandbox", "rm"), ("sandbox", "gc"), ("node", "ls"), ("node", "gc"),
    ("job", "verify"), ("job", "run"),
    ("fleet", "start"), ("fleet", "nodes"), ("fleet", "ls"), ("fleet", "rm"), ("fleet", "gc"),
    ("fleet", "stop"),
]


def _command(path: tuple[str, ...]) -> click.Command:
    ctx = click.Context(cli_main.cli)
    cmd: click.Command | None = cli_main.cli
    for name in path:
        assert isinstance(cmd, click.Group)
        cmd = cmd.get_command(ctx, name)
        assert cmd is not None, path
    return cmd


@pytest.mark.parametrize("path", REPORTING, ids=" ".join)
def test_every_listing_or_report_command_takes_json(path):
    opts = {o for p in _command(path).params if isinstance(p, click.Option) for o in p.opts}
    assert "--json" in opts, f"envbuild {' '.join(path)} has no --json"


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ENVBUILD_DEFS", raising=False)
    (tmp_path / "envdefs/base").mkdir(parents=True)
    (tmp_path / "envdefs/envs").mkdir(parents=True)
    (tmp_path / "envdefs/base/b.yaml").write_text(BASE)
    (tmp_path / "envdefs/envs/e.yaml").write_text(ENV)
    return tmp_path / "envdefs"


def test_validate_json_is_the_tree_and_its_counts(tree, capsys):
    assert main(["validate", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "ok": True, "root": "envdefs", "definitions": 2,
        "kinds": {"Base": 1, "Workspace": 0, "Toolkit": 0, "Env": 1, "Task": 0}}


def test_graph_json_is_format_json(tree, capsys):
    assert main(["graph", "--format", "json"]) == 0
    want = capsys.readouterr().out
    assert json.loads(want)["generations"] == [["b"], ["e"]]
    assert main(["graph", "--json"]) == 0
    assert capsys.readouterr().out == want
    assert main(["graph", "--json", "--format", "dot"]) == 2


def test_a_json_command_that_fails_prints_no_json_and_its_usual_error_lines(tree, capsys):
    (tree / "envs/e.yaml").write_text(ENV.replace("base: b", "base: nope"))
    assert main(["validate", "--json"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        "envdefs/envs/e.yaml:4:7: base 'nope': no Base with that name (at base)",
        "error: 1 problem in definitions"]


def test_dumps_lines_puts_each_item_of_a_top_level_list_on_a_line():
    doc = [{"id": "a", "n": 1}, {"id": "b", "labels": {"x": "y"}}]
    text = dumps_lines(doc)
    assert json.loads(text) == doc
    assert text.splitlines() == ["[", '  {"id": "a", "n": 1},',
                                 '  {"id": "b", "labels": {"x": "y"}}', "]"]


def _remover(fail: set[str]):
    seen: list[str] = []

    def remove(i: str) -> None:
        seen.append(i)
        if i in fail:
            raise RuntimeShimError(f"no sandbox {i}", hint="see envbuild sandbox ls")

    return remove, seen


def test_remove_each_tries_every_id_and_reports_failures(capsys):
    remove, seen = _remover({"b"})
    assert remove_each(["a", "b", "c"], remove, as_json=False) == 1
    assert seen == ["a", "b", "c"]
    assert capsys.readouterr().out.splitlines() == [
        "removed a", "failed  b: no sandbox b — see envbuild sandbox ls", "removed c"]


def test_remove_each_json(capsys):
    remove, _ = _remover({"b"})
    assert remove_each(["a", "b"], remove, as_json=True) == 1
    assert json.loads(capsys.readouterr().out) == {
        "removed": ["a"],
        "failed": [{"id": "b", "error": "no sandbox b", "hint": "see envbuild sandbox ls"}]}
    remove, _ = _remover(set())
    assert remove_each(["a"], remove, as_json=True) == 0
    assert json.loads(capsys.readouterr().out) == {"removed": ["a"], "failed": []}
