"""``envbuild graph``, ``plan`` and ``explain`` end to end on a small YAML tree (no git here;
``--changed-since``/``--against`` are in tests/integration/test_changed_since.py)."""

from __future__ import annotations

import json
import textwrap

import pytest

from envbuild.cli.main import main

TREE = {
    "envdefs/base/deb.yaml": """
        apiVersion: envbuild/v1
        kind: Base
        name: deb
        abi: deb12
        from: {debootstrap: {suite: bookworm}}
        """,
    "envdefs/workspaces/app.yaml": """
        apiVersion: envbuild/v1
        kind: Workspace
        name: app
        build_on: deb
        source: {path: ../../sources/app}
        steps:
          - run: pip install -e /workspace
        """,
    "envdefs/toolkits/rg.yaml": """
        apiVersion: envbuild/v1
        kind: Toolkit
        name: rg
        build_on: deb
        prefix: /opt/toolkits/rg
        steps:
          - run: cp /usr/bin/rg /opt/toolkits/rg/
        """,
    "envdefs/envs/swe.yaml": """
        apiVersion: envbuild/v1
        kind: Env
        name: swe
        base: deb
        workspace: app
        toolkits: [rg]
        """,
    "sources/app/app.py": "print('hi')\n",
}


@pytest.fixture
def tree(tmp_path, monkeypatch):
    for rel, text in TREE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text).lstrip())
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(capsys, *argv):
    code = main(["--defs", "envdefs", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_is_one_object(tree, capsys):
    code, out, _ = run(capsys, "plan", "--json")
    assert code == 0
    doc = json.loads(out)
    assert [x["name"] for x in doc["layers"]] == ["deb", "app", "rg"]
    assert doc["layers"][1]["depends_on"] == ["deb"] and doc["layers"][1]["status"] == "missing"
    assert doc["envs"] == [{"name": "swe", "layers": ["deb", "app", "rg"]}]


def test_plan_text_is_grouped_by_generation(tree, capsys):
    code, out, _ = run(capsys, "plan", "app")
    assert code == 0
    assert out.index("generation 0") < out.index("deb") < out.index("generation 1")
    assert "rg" not in out and "2 layers (2 missing), 0 envs" in out


def test_graph_formats(tree, capsys):
    assert run(capsys, "graph", "--format", "json")[0] == 0
    code, out, _ = run(capsys, "graph", "--format", "json")
    assert json.loads(out)["generations"] == [["deb"], ["app", "rg"], ["swe"]]
    code, out, _ = run(capsys, "graph", "--format", "dot")
    assert '"swe" -> "rg";' in out
    code, out, _ = run(capsys, "graph")
    assert "generation 2" in out


def test_explain_lists_every_input(tree, capsys):
    code, out, _ = run(capsys, "explain", "app")
    assert code == 0
    assert "build_on.abi: 'deb12'" in out and "steps[0].run: 'pip install -e /workspace'" in out
    assert "pinned.source: 'sha256:" in out
    code, out, _ = run(capsys, "explain", "--json", "swe")
    assert json.loads(out)["kind"] == "Env"


def test_errors_exit_1_with_file_and_line(tree, capsys):
    (tree / "envdefs/toolkits/rg.yaml").write_text(
        (tree / "envdefs/toolkits/rg.yaml").read_text().replace("build_on: deb", "build_on: dev"))
    code, _, err = run(capsys, "plan")
    assert code == 1
    assert "envdefs/toolkits/rg.yaml:4:11: build_on 'dev': no Base with that name" in err
    assert "did you mean 'deb'?" in err


def test_unknown_name_exits_1(tree, capsys):
    code, _, err = run(capsys, "explain", "ap")
    assert code == 1 and "did you mean 'app'?" in err


def test_plan_marks_layers_the_store_has_as_cached(tree, capsys, monkeypatch):
    from envbuild.cli.main import App
    from envbuild.store.helpers import KeyRecord, put_key_record
    from envbuild.store.memory import MemoryStore

    store = MemoryStore()
    monkeypatch.setattr(App, "open_store", lambda self: store)
    doc = json.loads(run(capsys, "plan", "--json")[1])
    assert not (tree / "cache").exists()  # no store yet: a dry run does not create one
    (tree / "cache").mkdir()
    deb = doc["layers"][0]
    digest = "sha256:" + "0" * 64
    put_key_record(store, deb["key"], KeyRecord(layer=digest, toc=digest, diff_id=digest, size=1))
    doc = json.loads(run(capsys, "plan", "--json")[1])
    assert [x["status"] for x in doc["layers"]] == ["cached", "missing", "missing"]


def test_plan_json_is_one_line_per_layer_and_the_same_document():
    import json

    from envbuild.cli.output import dumps_lines

    doc = {"layers": [{"name": f"w{i}", "depends_on": ["b"], "key": "sha256:" + "0" * 64}
                      for i in range(3)],
           "rebuild": [], "changes": {"relock": ["e"]}, "note": "é\n\"x\""}
    text = dumps_lines(doc)
    assert json.loads(text) == doc
    lines = text.splitlines()
    assert len(lines) == 1 + 1 + 3 + 1 + 3 + 1   # {, "layers": [, 3 items, ], 3 keys, }
    assert all(json.loads(line.strip().rstrip(",")) == doc["layers"][i]
               for i, line in enumerate(lines[2:5]))
    for other in ({}, [], [1, 2], "s", 3, None):
        assert json.loads(dumps_lines(other)) == other
