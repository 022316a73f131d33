"""Step labels (issue 38): an optional ``name:`` on every step, in the schema and the model but
never in the key, and a default label that skips what opens every script (``set -eu``)."""

from __future__ import annotations

import textwrap

import pytest

from envbuild.build.executor import _describe
from envbuild.defs import load_definitions
from envbuild.defs.model import CopyStep, RunStep, run_label
from envbuild.errors import DefinitionError
from envbuild.plan.graph import build_graph
from envbuild.plan.keys import compute_keys
from tests.unit.test_plan_support import base, defset, fake_pins, tk


@pytest.mark.parametrize("script, label", [
    ("set -eu\napt-get update\n", "apt-get update"),
    ("set -euo pipefail\n# fetch the sources\n\n  git clone x  \n", "git clone x"),
    ("set -o pipefail\nset +x\nshopt -s globstar\nmake -j4", "make -j4"),
    ("set -e; pip install six", "pip install six"),
    ("set -eux && make", "make"),
    ("#!/bin/sh\nset -e\necho hi", "echo hi"),
    ("echo one\necho two", "echo one"),
    ("settle --now", "settle --now"),            # a command that starts with "set"
    ("set -eu\n", "set -eu"),                    # nothing else: the first line
    ("set -eu\n# only a comment\n", "set -eu"),
])
def test_the_default_label_is_the_first_line_that_does_something(script, label):
    assert run_label(script) == label


def test_a_step_name_is_the_label_and_collapses_to_one_line():
    step = RunStep.from_mapping({"run": "set -eu\nmake", "name": "  build\n the   widgets "})
    assert step.name == "build the widgets" and step.label == "build the widgets"
    assert RunStep.from_mapping({"run": "set -eu\nmake"}).label == "make"
    copy = CopyStep.from_mapping({"copy": {"src": "a", "dest": "/b"}, "name": "the config"})
    assert copy.label == "the config"
    assert CopyStep.from_mapping({"copy": {"src": "a", "dest": "/b"}}).label == "a -> /b"


def test_progress_shows_the_label_shortened():
    assert _describe(RunStep(run="set -eu\napt-get install -y curl")) == "run: apt-get install -y curl"
    assert _describe(RunStep(run="x", name="y" * 80)) == "run: " + "y" * 59 + "…"
    assert _describe(CopyStep(src="a", dest="/b", name="conf")) == "copy: conf"


def test_the_schema_takes_a_name_on_run_and_copy_steps(tmp_path):
    root = tmp_path / "envdefs"
    (root / "base").mkdir(parents=True)
    (root / "base" / "b.yaml").write_text(textwrap.dedent("""\
        apiVersion: envbuild/v1
        kind: Base
        name: b
        abi: deb12
        from: {debootstrap: {suite: bookworm}}
        steps:
          - name: install the compilers
            run: set -eu; apt-get install -y gcc
          - name: the config
            copy: {src: files/conf, dest: /etc/conf}
        """))
    steps = load_definitions(root).by_name["b"].steps
    assert [s.name for s in steps] == ["install the compilers", "the config"]
    (root / "base" / "b.yaml").write_text(textwrap.dedent("""\
        apiVersion: envbuild/v1
        kind: Base
        name: b
        abi: deb12
        from: {debootstrap: {suite: bookworm}}
        steps:
          - name: ""
            run: make
        """))
    with pytest.raises(DefinitionError) as e:
        load_definitions(root)
    assert [(p.path, p.line) for p in e.value.problems] == [("steps[0].name", 7)]


def test_a_step_name_is_not_in_the_key():
    def keys(**named):
        d = defset(base("b", steps=[{"run": "set -eu\nmake", **named}]), tk("t", "b"))
        return compute_keys(build_graph(d), fake_pins(d)).layers

    assert keys() == keys(name="make it")
