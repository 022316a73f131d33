"""The example definitions in envdefs/ and the projects in sources/ keep their conventions.

Pure checks on the files (no subprocess, no network): what `envbuild validate` cannot know —
that a toolkit's copies and PATH stay under its prefix, that downloads are pinned, that
workspaces point at real projects, and that each file is named after its definition.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from envbuild.defs import load_definitions
from envbuild.defs.model import Base, CopyStep, Env, PathSource, RunStep, Toolkit, Workspace
from envbuild.plan.graph import build_graph
from tests.conftest import REPO

ENVDEFS = REPO / "envdefs"
SOURCES = REPO / "sources"
ABI = re.compile(r"^(debian\d+|busybox)-(amd64|arm64)(-py3\d+)?$")


@pytest.fixture(scope="module")
def defs():
    return load_definitions(ENVDEFS)


def of(defs, cls):
    return [d for d in defs.by_name.values() if isinstance(d, cls)]


def test_the_examples_load_and_form_a_valid_graph(defs):
    build_graph(defs)  # raises on unknown references, cycles, abi mismatches
    counts = {k: len(defs.of_kind(k)) for k in ("Base", "Workspace", "Toolkit", "Env")}
    assert counts["Base"] >= 3 and counts["Workspace"] >= 2
    assert counts["Toolkit"] >= 2 and counts["Env"] >= 3


def test_each_file_is_named_after_its_definition_and_sits_in_its_kind_dir(defs):
    dirs = {"Base": "base", "Workspace": "workspaces", "Toolkit": "toolkits", "Env": "envs",
            "Task": "tasks"}
    for d in defs.by_name.values():
        path = Path(d.origin.file)
        assert path.stem == d.name, d.origin.file
        assert path.parent.name == dirs[d.kind], d.origin.file


def test_every_kind_dir_has_a_readme():
    for sub in ("", "base", "workspaces", "toolkits", "envs"):
        assert (ENVDEFS / sub / "README.md").is_file()
    assert (SOURCES / "README.md").is_file()


def test_abi_strings_follow_the_documented_convention(defs):
    abis = {b.abi for b in of(defs, Base)}
    for d in of(defs, Toolkit) + of(defs, Workspace):
        abis.update(d.requires_abi)
    for abi in abis:
        assert ABI.match(abi), f"{abi!r} does not follow envdefs/base/README.md"


def test_copy_sources_exist(defs):
    for d in defs.by_name.values():
        for step in getattr(d, "steps", ()):
            if isinstance(step, CopyStep):
                assert (d.origin.directory / step.src).exists(), (d.name, step.src)


def test_toolkits_stay_under_their_prefix(defs):
    for t in of(defs, Toolkit):
        assert t.prefix == f"/opt/toolkits/{t.name}"
        for step in t.steps:
            if isinstance(step, CopyStep):
                assert step.dest.startswith(t.prefix + "/"), (t.name, step.dest)
            else:
                assert isinstance(step, RunStep)
                for key in ("TMPDIR",):
                    if key in step.env:
                        assert step.env[key].startswith(t.prefix + "/"), (t.name, key)
        assert t.config.env.get("PATH") == f"{t.prefix}/bin:$PATH", t.name
        assert set(t.config.env) <= {"PATH"}, t.name


def test_toolkit_network_steps_keep_their_state_under_the_prefix(defs):
    for t in of(defs, Toolkit):
        for step in t.steps:
            if not isinstance(step, RunStep):
                continue
            text = step.run
            if "apt-get" in text:
                assert "Dir::State::Lists=" in text and "Dir::Cache=" in text, t.name
                assert "apt-get install" not in text and "dpkg -i" not in text, t.name
                assert "sha256sum -c" in text, f"{t.name}: pin the .deb by sha256"
            if "pip" in text and "install" in text:
                assert "--no-cache-dir" in text and "--require-hashes" in text, t.name
                assert step.env.get("PIP_DISABLE_PIP_VERSION_CHECK") == "1", t.name
                assert step.env.get("SOURCE_DATE_EPOCH") == "0", t.name
                assert "TMPDIR" in step.env, t.name


def test_pip_requirements_are_pinned_with_hashes():
    req = (ENVDEFS / "toolkits" / "files" / "pytest" / "requirements.txt").read_text()
    logical = re.sub(r"\s*\\\n\s*", " ", req)
    lines = [ln for ln in logical.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines
    for line in lines:
        assert re.match(r"^[A-Za-z0-9_.-]+==[0-9][^ ]* --hash=sha256:[0-9a-f]{64}$", line), line


def test_workspaces_point_at_projects_in_sources(defs):
    for w in of(defs, Workspace):
        assert isinstance(w.source, PathSource)
        src = (w.origin.directory / w.source.path).resolve()
        assert src.parent == SOURCES.resolve(), w.name
        assert src.name == w.name and src.is_dir(), w.name
        assert w.dest == "/workspace"
        assert w.check, f"{w.name}: a workspace says how to check it still works"


def test_python_workspaces_are_importable_by_the_toolkit_pytest(defs):
    for w in of(defs, Workspace):
        src = (w.origin.directory / w.source.path).resolve()
        if not (src / "pyproject.toml").exists():
            continue
        text = (src / "pyproject.toml").read_text()
        assert 'pythonpath = ["."]' in text, w.name
        assert (src / w.name / "__init__.py").is_file(), w.name
        assert any(f"import {w.name}" in c for c in (c.run for c in w.check)), w.name
        assert not list(src.rglob(".pytest_cache")), f"stray .pytest_cache in {src}"


def test_shell_sources_are_executable():
    for rel in ("kvsh/bin/kv", "kvsh/tests/run.sh"):
        assert (SOURCES / rel).stat().st_mode & 0o111, rel
    assert (ENVDEFS / "toolkits" / "files" / "shtest" / "shtest").stat().st_mode & 0o111


def test_envs_work_in_their_workspace(defs):
    for e in of(defs, Env):
        assert e.config.user == "0:0", e.name
        if e.workspace:
            ws = defs.by_name[e.workspace]
            assert e.config.workdir == ws.dest, e.name
        if e.config.cmd:
            assert shlex.join(e.config.cmd)
