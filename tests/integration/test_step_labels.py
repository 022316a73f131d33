"""Build steps are labelled by what they do (issue 38): a step's ``name:``, else its first line
that is not blank, a comment or a shell option setting (``set -eu`` opens every script by
convention, so the first line said nothing). The label is in the progress lines and in the
failure, with real runc steps."""

from __future__ import annotations

import textwrap

import pytest

pytestmark = pytest.mark.integration


def _toolkit(envbuild_cli, steps: str) -> None:
    (envbuild_cli.defs / "toolkits" / "labels.yaml").write_text(textwrap.dedent("""\
        apiVersion: envbuild/v1
        kind: Toolkit
        name: labels
        build_on: busybox-tiny
        prefix: /opt/toolkits/labels
        steps:
        """) + textwrap.indent(textwrap.dedent(steps), "  "))


def test_a_failing_step_is_labelled_by_its_first_command_not_set_eu(envbuild_cli):
    _toolkit(envbuild_cli, """\
        - run: |
            set -eu
            # make the prefix
            mkdir -p /opt/toolkits/labels
          network: none
        - run: |
            set -euo pipefail 2>/dev/null || set -eu

            echo compiling the widgets; exit 3
          network: none
        """)
    r = envbuild_cli("build", "labels")
    assert r.code == 1, r.err
    assert "labels: step 1/2 run: mkdir -p /opt/toolkits/labels" in r.err, r.err
    assert "step 2/2 run: echo compiling the widgets; exit 3" in r.err, r.err
    error = next(ln for ln in r.err.splitlines() if ln.startswith("error: "))
    assert error.endswith("labels: step 2/2 exited 3: echo compiling the widgets; exit 3"), error
    assert "set -eu" not in error


def test_a_named_step_is_labelled_by_its_name(envbuild_cli):
    _toolkit(envbuild_cli, """\
        - name: make the prefix
          run: set -eu; mkdir -p /opt/toolkits/labels
          network: none
        - name: compile the widgets
          run: |
            set -eu
            exit 4
          network: none
        """)
    r = envbuild_cli("build", "labels")
    assert r.code == 1, r.err
    assert "labels: step 1/2 run: make the prefix" in r.err, r.err
    error = next(ln for ln in r.err.splitlines() if ln.startswith("error: "))
    assert error.endswith("labels: step 2/2 exited 4: compile the widgets"), error
