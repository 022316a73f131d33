"""The Task kind (issue 35, item 1, first increment): schema, model, graph edge, planning,
``validate``/``plan``/``explain`` on a tree with a task, and the example in ``envdefs/``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from envbuild.cli.main import main
from envbuild.defs import describe_counts, load_definitions
from envbuild.defs.model import DEFAULT_GRADE_TIMEOUT, GitSource, PathSource, Task
from envbuild.errors import DefinitionError, Problem
from envbuild.plan.graph import check_tree
from envbuild.store import LocalStore
from tests.docblocks import REPO

BASE = """\
apiVersion: envbuild/v1
kind: Base
name: deb
abi: deb12
from: {scratch: {}}
"""
ENV = """\
apiVersion: envbuild/v1
kind: Env
name: py-app
base: deb
"""
TASK = """\
apiVersion: envbuild/v1
kind: Task
name: fix-it
env: py-app
workdir: /workspace
hidden: {path: hidden}
grade: {run: "python3 -m pytest -q tests/test_hidden.py", timeout: 120}
"""


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ENVBUILD_DEFS", raising=False)
    for rel, text in {"base/deb.yaml": BASE, "envs/py-app.yaml": ENV,
                      "tasks/fix-it.yaml": TASK}.items():
        (tmp_path / "envdefs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "envdefs" / rel).write_text(text)
    (tmp_path / "envdefs/tasks/hidden/tests").mkdir(parents=True)
    (tmp_path / "envdefs/tasks/hidden/tests/test_hidden.py").write_text("def test_x(): pass\n")
    return tmp_path / "envdefs"


def write_task(tree: Path, text: str) -> None:
    (tree / "tasks/fix-it.yaml").write_text(textwrap.dedent(text))


def task_problems(tree: Path, extra: str = "", replace: tuple[str, str] = ("", "")) -> list[Problem]:
    write_task(tree, TASK.replace(*replace) + extra)
    with pytest.raises(DefinitionError) as info:
        check_tree(tree)
    return info.value.problems


def one(tree: Path, extra: str = "", replace: tuple[str, str] = ("", "")) -> Problem:
    found = task_problems(tree, extra, replace)
    assert len(found) == 1, [p.render() for p in found]
    return found[0]


# ---------------------------------------------------------------------- model


def test_a_minimal_task_loads_with_defaults(tree):
    t = load_definitions(tree).by_name["fix-it"]
    assert isinstance(t, Task) and t.kind == "Task"
    assert (t.env, t.workdir, t.hidden) == ("py-app", "/workspace", PathSource("hidden"))
    assert (t.grade.run, t.grade.timeout) == ("python3 -m pytest -q tests/test_hidden.py", 120.0)
    assert t.editable == ("/workspace",)  # default: the whole workdir
    assert (t.must_pass, t.keep_passing, t.junit, t.grade.user) == ((), (), None, None)


def test_the_swe_fields_are_normalised_under_workdir(tree):
    write_task(tree, TASK.replace("timeout: 120", "env: {CI: 1}, user: 1000") + """\
        editable: [src/pkg, /workspace/docs/, ./setup.py]
        tests: {must_pass: ["tests/test_x.py::test_new"], keep_passing: ["tests/test_x.py::test_old"]}
        junit: /tmp/grade/junit.xml
        """.replace("        ", ""))
    t = load_definitions(tree).by_name["fix-it"]
    assert t.editable == ("/workspace/src/pkg", "/workspace/docs", "/workspace/setup.py")
    assert t.must_pass == ("tests/test_x.py::test_new",)
    assert t.keep_passing == ("tests/test_x.py::test_old",)
    assert t.junit == "/tmp/grade/junit.xml"
    assert (t.grade.timeout, dict(t.grade.env), t.grade.user) == (DEFAULT_GRADE_TIMEOUT,
                                                                  {"CI": "1"}, "1000")
    assert t.identity()["editable"] == list(t.editable)


def test_hidden_takes_any_workspace_source_kind(tree):
    write_task(tree, TASK.replace("{path: hidden}", "{git: {url: ../repo.git, rev: v1}}"))
    assert load_definitions(tree).by_name["fix-it"].hidden == GitSource(url="../repo.git", rev="v1")


# ---------------------------------------------------------------------- schema and paths


def test_relative_workdir_is_refused_at_its_line(tree):
    p = one(tree, replace=("workdir: /workspace", "workdir: workspace"))
    assert (p.file, p.line, p.path) == ("envdefs/tasks/fix-it.yaml", 5, "workdir")
    assert "is not a valid absolute path" in p.message and "starts with '/'" in p.hint


@pytest.mark.parametrize("timeout", ["0", "-5"])
def test_a_timeout_must_be_positive(tree, timeout):
    p = one(tree, replace=("timeout: 120", f"timeout: {timeout}"))
    assert (p.line, p.path) == (7, "grade.timeout")
    assert p.message == f"timeout: must be more than 0, got {timeout}"


def test_unknown_grade_key_gets_a_hint(tree):
    p = one(tree, replace=("timeout: 120", "timout: 120"))
    assert p.message == "unknown key 'timout'" and "did you mean 'timeout'?" in p.hint


def test_hidden_needs_one_source_key(tree):
    p = one(tree, replace=("{path: hidden}", "{path: a, git: {url: x, rev: y}}"))
    assert p.path == "hidden" and "needs exactly one of" in p.message


def test_missing_grade_names_what_a_task_needs(tree):
    p = one(tree, replace=('grade: {run: "python3 -m pytest -q tests/test_hidden.py", '
                           'timeout: 120}\n', ""))
    assert p.message == "missing required key 'grade'"
    assert p.hint == "a Task needs name, env, workdir, hidden, grade"


@pytest.mark.parametrize("path", ["/etc", "../other", "src/../../x", "/workspacex"])
def test_an_editable_path_outside_workdir_is_refused(tree, path):
    p = one(tree, f"editable: [src, '{path}']\n")
    assert (p.file, p.line, p.path) == ("envdefs/tasks/fix-it.yaml", 8, "editable[1]")
    assert p.message == f"editable: {path!r} is outside workdir '/workspace'"


def test_a_junit_report_the_agent_may_write_is_refused(tree):
    p = one(tree, "junit: report.xml\n")  # under workdir, which is editable by default
    assert (p.line, p.path) == (8, "junit") and "could forge" in p.message
    p = one(tree, "editable: [src]\njunit: src/report.xml\n")
    assert p.path == "junit"
    write_task(tree, TASK + "editable: [src]\njunit: report.xml\n")  # outside src: fine
    assert load_definitions(tree).by_name["fix-it"].junit == "/workspace/report.xml"


def test_tests_need_a_junit_report(tree):
    p = one(tree, "tests: {must_pass: [t1]}\n")
    assert p.path == "tests" and "no junit report" in p.message and "--junitxml" in p.hint


# ---------------------------------------------------------------------- graph and plan


def test_the_task_depends_on_its_env(tree):
    g = check_tree(tree)
    assert g.dependencies("fix-it") == ("py-app",)
    assert g.generations() == [["deb"], ["py-app"], ["fix-it"]]
    assert g.closure(["fix-it"]) == {"deb", "py-app", "fix-it"}


def test_an_unknown_env_gets_did_you_mean(tree):
    p = one(tree, replace=("env: py-app", "env: py-ap"))
    assert (p.file, p.line, p.column, p.path) == ("envdefs/tasks/fix-it.yaml", 4, 6, "env")
    assert p.message == "env 'py-ap': no Env with that name"
    assert p.hint == "did you mean 'py-app'?"


def test_an_env_that_is_not_an_env_is_refused(tree):
    p = one(tree, replace=("env: py-app", "env: deb"))
    assert p.message == "env 'deb' is a Base, not an Env"


def test_validate_and_plan_list_the_task(tree, capsys):
    assert main(["validate"]) == 0
    assert "(1 base, 0 workspaces, 0 toolkits, 1 env, 1 task)" in capsys.readouterr().out
    assert main(["validate", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kinds"]["Task"] == 1
    assert main(["plan", "--json", "fix-it"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [x["name"] for x in doc["layers"]] == ["deb"]  # the env's layers; no task layer
    assert doc["envs"] == [{"name": "py-app", "layers": ["deb"]}]
    [task] = doc["tasks"]
    assert (task["name"], task["env"]) == ("fix-it", "py-app")
    hidden = task["hidden"]
    assert (hidden["name"], hidden["status"]) == ("fix-it:hidden", "missing")
    assert hidden["key"].startswith("sha256:") and hidden["key"] != doc["layers"][0]["key"]
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert f"missing  fix-it  py-app  fix-it:hidden  {hidden['key'][:19]}" in out
    assert "1 layers (1 missing), 1 envs, 1 task" in out


def test_explain_of_a_task_prints_its_hidden_layers_key(tree, capsys):
    assert main(["plan", "--json", "fix-it"]) == 0
    key = json.loads(capsys.readouterr().out)["tasks"][0]["hidden"]["key"]
    assert main(["explain", "--json", "fix-it"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["kind"], doc["digest"]) == ("Task", key)
    assert doc["inputs"]["dest"] == "/workspace" and doc["inputs"]["kind"] == "TaskHidden"
    assert "path" in doc["inputs"]["source"] and doc["inputs"]["pinned"]["source"].startswith("sha")
    assert main(["explain", "fix-it", "--against", "HEAD"]) == 1
    err = capsys.readouterr().err
    assert "its hidden layer's key is not compared across revisions" in err


def test_lock_of_a_task_whose_hidden_layer_is_not_built_writes_nothing(tree, capsys,
                                                                       monkeypatch, tmp_path):
    monkeypatch.setenv("ENVBUILD_STORE", str(tmp_path / "store"))
    assert main(["lock", "fix-it"]) == 1
    err = capsys.readouterr().err
    assert "cannot lock fix-it: its hidden layer is not built" in err
    assert "envbuild build fix-it" in err
    assert LocalStore(tmp_path / "store").list_refs() == []  # not even the env's lock


# ---------------------------------------------------------------------- the example


def test_the_envdefs_example_task_validates():
    graph = check_tree(REPO / "envdefs")
    t = graph.defs.by_name["textstats-empty-input"]
    assert isinstance(t, Task) and graph.dependencies(t.name) == ("py-textstats",)
    env = graph.defs.by_name["py-textstats"]
    workspace = graph.defs.by_name[env.workspace]  # type: ignore[union-attr]
    assert t.workdir == workspace.dest  # type: ignore[union-attr]
    hidden = Path(t.origin.directory) / t.hidden.path  # type: ignore[union-attr]
    assert (hidden / "tests/test_hidden_empty.py").is_file()
    assert t.junit is not None and not t.junit.startswith(t.workdir + "/")
    ids = [i.split("::")[1] for i in t.must_pass]
    text = (hidden / "tests/test_hidden_empty.py").read_text()
    assert all(f"def {i}(" in text for i in ids)
    assert "1 task)" in describe_counts(graph.defs)
