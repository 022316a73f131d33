"""Every kind of problem the loader reports: where (file, line, column, path) and the hint."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from envbuild.defs import load_definitions
from envbuild.errors import DefinitionError, Problem

HEADER = "apiVersion: envbuild/v1\n"
ENV = HEADER + "kind: Env\nname: e\nbase: b\n"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def problems(files: dict[str, str]) -> list[Problem]:
    for rel, text in files.items():
        path = Path("d") / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    with pytest.raises(DefinitionError) as info:
        load_definitions("d")
    return info.value.problems


def one(text: str, rel: str = "a.yaml") -> Problem:
    found = problems({rel: text})
    assert len(found) == 1, [p.render() for p in found]
    return found[0]


def test_yaml_syntax_error_points_at_the_mark():
    p = one(ENV + "toolkits: [a, b\nconfig: {}\n")
    assert (p.file, p.line, p.column) == ("d/a.yaml", 6, 7)
    assert p.message.startswith("invalid yaml: ")  # the wording is libyaml's
    assert p.message.endswith("(while parsing a flow sequence at line 5)")
    assert p.hint == "check the indentation and quoting near this line"


def test_syntax_error_in_a_later_document_keeps_the_problems_of_earlier_ones():
    found = problems({"a.yaml": ENV + "bogus: 1\n---\nkey: [\n"})
    assert [(p.line, p.message.split(":")[0]) for p in found] == [
        (5, "unknown key 'bogus'"), (8, "invalid yaml")]


def test_empty_file():
    p = one("# only a comment\n")
    assert (p.file, p.line, p.column) == ("d/a.yaml", 0, 0)
    assert p.message == "empty file: no definitions in it"
    assert p.hint == "add a definition, or delete the file"


@pytest.mark.parametrize("text, got", [("- a\n- b\n", "a list"), ("just text\n", "'just text'")])
def test_document_that_is_not_a_mapping(text, got):
    p = one(ENV + "---\n" + text)
    assert (p.line, p.column) == (6, 1)
    assert p.message == f"a definition must be a mapping, got {got}"
    assert p.hint == "start the document with 'apiVersion: envbuild/v1'"


def test_missing_api_version():
    p = one("kind: Env\nname: e\nbase: b\n")
    assert (p.line, p.column) == (1, 1)
    assert p.message == "missing apiVersion"
    assert p.hint == "use apiVersion: envbuild/v1"


def test_wrong_api_version_points_at_the_value():
    p = one(ENV.replace("envbuild/v1", "envbuild/v2"))
    assert (p.line, p.column, p.path) == (1, 13, "apiVersion")
    assert p.message == "unsupported apiVersion 'envbuild/v2'"
    assert p.hint == "use apiVersion: envbuild/v1"


def test_unknown_kind_suggests_the_closest():
    p = one(ENV.replace("kind: Env", "kind: Toolkt"))
    assert (p.line, p.column, p.path) == (2, 7, "kind")
    assert p.message == "unknown kind 'Toolkt'"
    assert p.hint == "did you mean 'Toolkit'?"


def test_missing_kind_lists_the_kinds():
    p = one(HEADER + "name: e\n")
    assert (p.line, p.message) == (1, "missing kind")
    assert p.hint == "kind is one of Base, Workspace, Toolkit, Env, Task"


def test_unknown_key_points_at_the_key_and_suggests():
    p = one(ENV + "toolkit: [rg]\n")
    assert (p.file, p.line, p.column, p.path) == ("d/a.yaml", 5, 1, "toolkit")
    assert p.message == "unknown key 'toolkit'"
    assert p.hint == "did you mean 'toolkits'?"
    assert p.render() == ("d/a.yaml:5:1: unknown key 'toolkit' (at toolkit)"
                          " — did you mean 'toolkits'?")


def test_unknown_key_without_a_close_match_lists_the_allowed_keys():
    p = one(ENV + "config: {zzz: 1}\n")
    assert (p.line, p.column, p.path) == (5, 10, "config.zzz")
    assert p.hint == "allowed here: env, workdir, user, cmd, hostname"


def test_missing_required_key_points_at_the_mapping():
    p = one(HEADER + "kind: Toolkit\nname: t\nbuild_on: b\n")
    assert (p.line, p.column, p.path) == (1, 1, "")
    assert p.message == "missing required key 'prefix'"
    assert p.hint == "a Toolkit needs name, build_on, prefix"


def test_missing_nested_key_points_at_the_nested_mapping():
    p = one(HEADER + "kind: Workspace\nname: w\nbuild_on: b\n"
            "source:\n  git: {url: https://x}\n")
    assert (p.line, p.column, p.path) == (6, 8, "source.git")
    assert p.message == "missing required key 'rev'"
    assert p.hint == "git needs url, rev"


def test_every_missing_key_is_reported():
    found = problems({"a.yaml": HEADER + "kind: Base\n"})
    assert [p.message for p in found] == ["missing required key 'abi'",
                                          "missing required key 'from'",
                                          "missing required key 'name'"]


def test_wrong_type_names_the_field_and_both_types():
    p = one(ENV + "toolkits: ripgrep\n")
    assert (p.line, p.column, p.path) == (5, 11, "toolkits")
    assert p.message == "toolkits: expected a list of names, got a string"
    assert p.hint == "write a list: toolkits: [ripgrep]"


def test_wrong_type_of_a_list_of_strings():
    p = one(HEADER + "kind: Workspace\nname: w\nbuild_on: b\nsource: {path: .}\n"
            "check: python3 -V\n")
    assert p.message == "check: expected a list of check commands, got a string"
    assert (p.line, p.column) == (6, 8)


def test_number_where_a_string_belongs_suggests_quotes():
    p = one(ENV + "config: {workdir: /w, hostname: 1.10}\n")
    assert (p.line, p.column, p.path) == (5, 33, "config.hostname")
    assert p.message == "hostname: expected a string, got a number"
    assert p.hint == "put the value in quotes to make it a string"


def test_bad_enum_value_lists_the_allowed_ones():
    p = one(HEADER + "kind: Base\nname: b\nabi: a\nfrom: {scratch: {}}\nframing: lazyy\n")
    assert (p.line, p.column, p.path) == (6, 10, "framing")
    assert p.message == "framing: expected one of 'lazy', 'compact', got 'lazyy'"
    assert p.hint == "did you mean 'lazy'?"


def test_bad_name_says_what_a_name_may_contain():
    p = one(ENV.replace("name: e", "name: My_Env"))
    assert (p.line, p.column, p.path) == (3, 7, "name")
    assert p.message == "name: 'My_Env' is not a valid name"
    assert p.hint.startswith("a name may contain lowercase letters, digits, '-', '.', '_'")


def test_bad_sha256():
    p = one(HEADER + "kind: Workspace\nname: w\nbuild_on: b\n"
            "source: {archive: {path: a.tar, sha256: abc}}\n")
    assert (p.line, p.path) == (5, "source.archive.sha256")
    assert p.message == "sha256: 'abc' is not a valid sha256 digest"
    assert "64 lowercase hex digits" in p.hint


def test_bad_environment_variable_name_points_at_the_key():
    p = one(ENV + "config:\n  env: {1X: a}\n")
    assert (p.line, p.column, p.path) == (6, 9, "config.env.1X")
    assert p.message == "'1X' is not a valid environment variable name"


def test_relative_prefix_is_refused():
    p = one(HEADER + "kind: Toolkit\nname: t\nbuild_on: b\nprefix: opt/t\n")
    assert (p.line, p.column, p.path) == (5, 9, "prefix")
    assert p.message == "prefix: 'opt/t' is not a valid absolute path"
    assert p.hint == "an absolute path starts with '/'"


def test_step_without_run_or_copy_is_one_problem():
    p = one(HEADER + "kind: Base\nname: b\nabi: a\nfrom: {scratch: {}}\nsteps:\n  - rn: ls\n")
    assert (p.line, p.column, p.path) == (7, 5, "steps[0]")
    assert p.message == "a step needs exactly one of 'run' or 'copy'"
    assert p.hint == "did you mean 'run'?"


def test_step_with_both_run_and_copy_is_one_problem():
    p = one(HEADER + "kind: Base\nname: b\nabi: a\nfrom: {scratch: {}}\n"
            "steps: [{run: ls, copy: {src: a, dest: /a}}]\n")
    assert p.message == "a step needs exactly one of 'run' or 'copy'"
    assert p.path == "steps[0]"


def test_a_run_step_reports_its_own_errors():
    found = problems({"a.yaml": HEADER + "kind: Base\nname: b\nabi: a\nfrom: {scratch: {}}\n"
                                "steps:\n  - run: ls\n    network: off-ish\n    workdr: /x\n"})
    assert [(p.line, p.path, p.hint) for p in found] == [
        (8, "steps[0].network", None),
        (9, "steps[0].workdr", "did you mean 'workdir'?")]
    assert found[0].message == "network: expected one of 'host', 'none', got 'off-ish'"


def test_from_needs_exactly_one_source():
    p = one(HEADER + "kind: Base\nname: b\nabi: a\nfrom: {scratch: {}, base: x}\n")
    assert (p.line, p.column, p.path) == (5, 7, "from")
    assert p.message == ("from needs exactly one of 'debootstrap', 'rootfs', 'oci', 'scratch', "
                         "'base', 'busybox', 'image', 'dockerfile'")


def test_rootfs_is_a_path_or_a_mapping():
    p = one(HEADER + "kind: Base\nname: b\nabi: a\nfrom: {rootfs: [x]}\n")
    assert p.path == "from.rootfs"
    assert p.message == "rootfs: expected a string or a mapping, got a list"


def test_duplicate_key_in_a_mapping():
    p = one(ENV + "base: c\n")
    assert (p.line, p.column, p.path) == (5, 1, "base")
    assert p.message == "duplicate key 'base'"
    assert p.hint == "it is already set on line 4"


def test_unsupported_tag_is_one_problem():
    p = one(ENV + "workspace: !secret w\n")
    assert (p.line, p.path) == (5, "workspace")
    assert p.message == "unsupported yaml tag '!secret'"


def test_standard_tags_are_shown_short():
    p = one(ENV + "workspace: !!binary aGVsbG8=\n")
    assert p.message == "unsupported yaml tag '!!binary'"


def test_duplicate_names_across_files_point_at_both():
    found = problems({"a.yaml": ENV, "b/c.yaml": "# the same name again\n" + ENV})
    assert len(found) == 1
    p = found[0]
    assert (p.file, p.line, p.column, p.path) == ("d/b/c.yaml", 4, 7, "name")
    assert p.message == "duplicate name 'e', first defined at d/a.yaml:3"
    assert p.hint == "names are unique across bases, workspaces, toolkits, envs and tasks"


def test_problems_are_collected_across_files_and_documents():
    found = problems({
        "base/a.yaml": HEADER + "kind: Base\nname: b\nabi: Bad\nfrom: {scratch: {}}\n",
        "envs/e.yaml": ENV + "toolkit: []\n---\n" + ENV.replace("name: e", "name: f")
        + "workspace: [w]\n",
    })
    assert [(p.file, p.line, p.path) for p in found] == [
        ("d/base/a.yaml", 4, "abi"),
        ("d/envs/e.yaml", 5, "toolkit"),
        ("d/envs/e.yaml", 11, "workspace"),
    ]


def test_a_valid_document_next_to_a_broken_one_is_not_returned():
    found = problems({"a.yaml": ENV, "b.yaml": ENV.replace("name: e", "name: f") + "x: 1\n"})
    assert [p.message for p in found] == ["unknown key 'x'"]


def test_missing_directory():
    with pytest.raises(DefinitionError) as info:
        load_definitions("nowhere")
    (p,) = info.value.problems
    assert (p.file, p.message) == ("nowhere", "definition directory: no such directory")
    assert "ENVBUILD_DEFS" in p.hint


def test_directory_without_definitions(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "README.md").write_text("hi\n")
    with pytest.raises(DefinitionError) as info:
        load_definitions("d")
    (p,) = info.value.problems
    assert p.message == "no definitions found (no *.yaml or *.yml files)"
    assert p.hint == "add definitions under base/, workspaces/, toolkits/ and envs/"


def test_file_that_is_not_utf8():
    Path("d").mkdir()
    Path("d/a.yaml").write_bytes(b"name: \xff\n")
    with pytest.raises(DefinitionError) as info:
        load_definitions("d")
    (p,) = info.value.problems
    assert p.message.startswith("file is not utf-8 text")
