"""The loader on valid trees: what the model gets, where positions point, which files count."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from envbuild.defs import load as load_mod
from envbuild.defs import load_definitions
from envbuild.defs.model import (
    Base,
    CopyStep,
    DebootstrapSource,
    Env,
    GitSource,
    PathSource,
    RunStep,
    Toolkit,
    Workspace,
)

BASE = """\
apiVersion: envbuild/v1
kind: Base
name: debian-bookworm-py311
abi: debian12-amd64-py311
from: {debootstrap: {suite: bookworm, variant: minbase, include: [ca-certificates]}}
steps:
  - run: apt-get install -y python3
    env: {DEBIAN_FRONTEND: noninteractive}
    network: host
config: {env: {LANG: C.UTF-8}}
"""

TOOLKIT = """\
apiVersion: envbuild/v1
kind: Toolkit
name: ripgrep
requires: {abi: [debian12-amd64-py311, debian12-amd64]}
build_on: debian-bookworm-py311
prefix: /opt/toolkits/ripgrep/
steps:
  - copy: {src: files/rg, dest: /opt/toolkits/ripgrep/bin/rg, mode: "0755"}
config: {env: {PATH: /opt/toolkits/ripgrep/bin:$PATH}}
pin: digest
"""

WORKSPACE = """\
apiVersion: envbuild/v1
kind: Workspace
name: requests-2-32
build_on: debian-bookworm-py311
source: {path: ../../sources/requests}
dest: /workspace
steps:
  - run: pip install --no-deps -e /workspace
check: [python3 -c "import requests"]
---
apiVersion: envbuild/v1
kind: Workspace
name: flask-3
build_on: debian-bookworm-py311
source: {git: {url: https://github.com/pallets/flask, rev: "3.0.0"}}
"""

ENV = """\
apiVersion: envbuild/v1
kind: Env
name: swe-requests
base: debian-bookworm-py311
workspace: requests-2-32
toolkits: [ripgrep]
config: {workdir: /workspace, user: 0:0, cmd: bash}
"""


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "envdefs"
    write(root, "base/debian.yaml", BASE)
    write(root, "toolkits/ripgrep.yml", TOOLKIT)
    write(root, "workspaces/python.yaml", WORKSPACE)
    write(root, "envs/swe.yaml", ENV)
    return root


def test_valid_tree_loads_into_the_model(tree):
    defs = load_definitions("envdefs")
    assert defs.root == "envdefs"
    assert sorted(defs.by_name) == ["debian-bookworm-py311", "flask-3", "requests-2-32",
                                    "ripgrep", "swe-requests"]

    base = defs.by_name["debian-bookworm-py311"]
    assert isinstance(base, Base)
    assert base.abi == "debian12-amd64-py311"
    assert base.source == DebootstrapSource(suite="bookworm", variant="minbase",
                                            include=("ca-certificates",))
    (step,) = base.steps
    assert isinstance(step, RunStep)
    assert step.run == "apt-get install -y python3"
    assert dict(step.env) == {"DEBIAN_FRONTEND": "noninteractive"}
    assert dict(base.config.env) == {"LANG": "C.UTF-8"}

    tk = defs.by_name["ripgrep"]
    assert isinstance(tk, Toolkit)
    assert tk.prefix == "/opt/toolkits/ripgrep"
    assert tk.requires_abi == ("debian12-amd64-py311", "debian12-amd64")
    assert tk.pin == "digest"
    assert tk.steps == (CopyStep(src="files/rg", dest="/opt/toolkits/ripgrep/bin/rg", mode=0o755),)

    ws = defs.by_name["requests-2-32"]
    assert isinstance(ws, Workspace)
    assert ws.source == PathSource("../../sources/requests")  # kept as written
    assert [c.run for c in ws.check] == ['python3 -c "import requests"']
    assert defs.by_name["flask-3"].source == GitSource(url="https://github.com/pallets/flask",
                                                       rev="3.0.0")

    env = defs.by_name["swe-requests"]
    assert isinstance(env, Env)
    assert (env.base, env.workspace, env.toolkits) == ("debian-bookworm-py311", "requests-2-32",
                                                        ("ripgrep",))
    # Unquoted 0:0 would be the base-60 integer 0 in YAML 1.1; the loader keeps the text.
    assert env.config.user == "0:0"
    assert env.config.cmd == ("/bin/sh", "-c", "bash")


def test_origin_records_file_and_every_node_position(tree):
    defs = load_definitions("envdefs")
    env = defs.by_name["swe-requests"]
    assert env.origin.file == "envdefs/envs/swe.yaml"
    assert env.origin.directory == Path("envdefs/envs")
    assert (env.origin.line, env.origin.column) == (1, 1)
    assert env.origin.position("base") == (4, 7)
    assert env.origin.position("toolkits[0]") == (6, 12)
    assert env.origin.position("config.user") == (7, 37)
    assert env.origin.position("no.such.path") == (1, 1)

    base = defs.by_name["debian-bookworm-py311"]
    assert base.origin.position("from.debootstrap.suite") == (5, 29)
    assert base.origin.position("steps[0].run") == (7, 10)
    assert base.origin.position("steps[0].env.DEBIAN_FRONTEND") == (8, 28)

    flask = defs.by_name["flask-3"]  # the second document of its file
    assert (flask.origin.line, flask.origin.column) == (11, 1)
    assert flask.origin.position("build_on") == (14, 11)


def test_absolute_root_below_cwd_is_shown_relative(tree):
    defs = load_definitions(tree)
    assert defs.root == "envdefs"
    assert defs.by_name["ripgrep"].origin.file == "envdefs/toolkits/ripgrep.yml"


def test_only_yaml_files_count_and_hidden_ones_are_skipped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "d/base/a.yaml", BASE)
    write(tmp_path, "d/README.md", "kind: nonsense\n")
    write(tmp_path, "d/base/notes.txt", "kind: nonsense\n")
    write(tmp_path, "d/.git/x.yaml", "kind: nonsense\n")
    write(tmp_path, "d/base/.#a.yaml", "kind: nonsense\n")
    assert list(load_definitions("d").by_name) == ["debian-bookworm-py311"]


def test_files_are_read_in_sorted_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("c", "a", "b"):
        write(tmp_path, f"d/{name}/x.yaml", ENV.replace("swe-requests", f"env-{name}"))
    assert list(load_definitions("d").by_name) == ["env-a", "env-b", "env-c"]


def test_empty_documents_and_trailing_separators_are_skipped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "d/e.yaml", "---\n# nothing\n---\n" + ENV + "---\n")
    assert list(load_definitions("d").by_name) == ["swe-requests"]


def test_anchors_and_aliases_are_plain_values(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "d/e.yaml", ENV.replace("config: {workdir: /workspace, user: 0:0, cmd: bash}",
                                            "config: {env: {A: &v /x, B: *v}, workdir: *v}"))
    config = load_definitions("d").by_name["swe-requests"].config
    assert dict(config.env) == {"A": "/x", "B": "/x"}
    assert config.workdir == "/x"


def test_libyaml_loader_is_used_when_available():
    if getattr(yaml, "__with_libyaml__", False):
        assert load_mod.Loader is yaml.CSafeLoader
    else:
        assert load_mod.Loader is yaml.SafeLoader


def test_loading_the_current_directory_names_files_without_a_dot_prefix(tree, monkeypatch):
    monkeypatch.chdir(tree)
    for root in (".", tree):
        defs = load_definitions(root)
        assert defs.by_name["ripgrep"].origin.file == "toolkits/ripgrep.yml"
