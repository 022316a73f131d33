"""YAML limits (``envbuild.defs.load.check_yaml_limits``): alias bombs, recursive aliases,
depth and size are refused on parser events, before anything is composed or expanded."""

from __future__ import annotations

import time

import pytest

from envbuild.defs import load as load_mod
from envbuild.defs.load import MAX_YAML_DEPTH, MAX_YAML_NODES, check_yaml_limits, load_definitions
from envbuild.errors import DefinitionError
from envbuild.jobs.load import JobManifestError, parse_job_manifest

LAUGHS = 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 10))


def _render(text: str) -> str | None:
    p = check_yaml_limits(text, "f.yaml")
    return None if p is None else p.render()


def test_billion_laughs_is_refused_at_the_alias_that_overflows_in_microseconds():
    t0 = time.perf_counter()
    got = _render(LAUGHS)
    assert time.perf_counter() - t0 < 0.05
    # a3 stands for 11,111 nodes; on line 5, a4's ninth *a3 passes 100,000
    assert got.startswith("f.yaml:5:38:") and "alias *a3 makes the document larger than " \
        f"{MAX_YAML_NODES} nodes" in got, got


@pytest.mark.parametrize("text", [
    "a: &v /x\nb: *v\n",
    "a: &m {x: 1, y: [1, 2]}\nb: *m\nc: [*m, *m]\n",
    "a: &s [1, 2, 3]\n---\nb: &s [4]\nc: *s\n",      # anchors are per document
    "a: " + "[" * (MAX_YAML_DEPTH - 1) + "]" * (MAX_YAML_DEPTH - 1) + "\n",
    "[" + ",".join(["1"] * (MAX_YAML_NODES - 1)) + "]",
    "a: *undefined\n",          # the composer reports it
    "a: [unclosed\n",           # the loader reports syntax errors
])
def test_ordinary_documents_pass(text):
    assert _render(text) is None


@pytest.mark.parametrize("text, message", [
    ("a: &r [1, *r]\n", "f.yaml:1:11: alias *r is inside its own anchor"),
    ("a: &r {b: {c: *r}}\n", "f.yaml:1:15: alias *r is inside its own anchor"),
    ("a: " + "[" * MAX_YAML_DEPTH + "]" * MAX_YAML_DEPTH + "\n",
     f"f.yaml:1:{3 + MAX_YAML_DEPTH}: document has nesting deeper than {MAX_YAML_DEPTH}"),
    ("a: &d " + "[" * 40 + "]" * 40 + "\nb: " + "[" * 30 + "*d" + "]" * 30 + "\n",
     f"f.yaml:2:34: alias *d makes nesting deeper than {MAX_YAML_DEPTH} levels"),
    ("[" + ",".join(["1"] * (MAX_YAML_NODES + 1)) + "]",
     f"document has more than {MAX_YAML_NODES} nodes"),
])
def test_limits_name_the_line(text, message):
    got = _render(text)
    assert got is not None and message in got, got


def test_file_size_is_limited(monkeypatch):
    monkeypatch.setattr(load_mod, "MAX_YAML_BYTES", 100)
    got = _render("a: " + "x" * 200 + "\n")
    assert got.startswith("f.yaml: file is 204 characters, over the 0 MiB limit"), got


def test_definitions_and_job_manifests_refuse_bombs_as_one_problem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "bomb.yaml").write_text("apiVersion: envbuild/v1\nkind: Env\n" + LAUGHS)
    with pytest.raises(DefinitionError) as ei:
        load_definitions("d")
    assert [p.line for p in ei.value.problems] == [7]
    with pytest.raises(JobManifestError) as ei:
        parse_job_manifest("apiVersion: envbuild/v1\nkind: JobManifest\n" + LAUGHS, "j.yaml")
    assert [(p.file, p.line) for p in ei.value.problems] == [("j.yaml", 7)]
    with pytest.raises(JobManifestError, match="1 problem"):
        parse_job_manifest('{"groups": ' + "[" * 200 + "]" * 200 + "}", "j.json")
