"""The build host against hostile definitions, images and tarballs (issue 11, items 1, 2, 8,
11, 13, 14 and the sparse part of 9), each through the real CLI or the real importer.

Every attack asserts the secure outcome: nothing is written or removed outside the build, the
CLI prints one line (no traceback) and exits 1, nothing is published.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from envbuild.store import LocalStore
from tests.conftest import require_tool

HEX40 = "0123456789abcdef0123456789abcdef01234567"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _one_line_error(result) -> None:
    assert result.code == 1, (result.code, result.out, result.err)
    assert "Traceback" not in result.err and "this is a bug" not in result.err, result.err
    assert result.err.strip(), "no error message"


def _published(cli) -> set[str]:
    """Key records in the CLI's store (what a build published)."""
    keys = Path(cli.store) / "keys"
    return {p.name for p in keys.rglob("*") if p.is_file()} if keys.exists() else set()


# ----------------------------------------------------------------------------- item 1: git


@pytest.mark.parametrize("command", ["validate", "build"])
def test_git_url_is_never_an_option_of_git(envbuild_cli, tmp_path, monkeypatch, command):
    """The issue's exact attack: ``--upload-pack=...`` as url and a 40-hex rev (which skips
    ``ls-remote``); before the fix ``envbuild build`` ran the command as root."""
    require_tool("git")
    marker = tmp_path / "pwned"
    monkeypatch.setenv("X", str(marker))
    _write(tmp_path / "envdefs" / "workspaces" / "evil.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: evil
        build_on: busybox-tiny
        source: {{git: {{url: "--upload-pack=touch $X;exit 1 #@x:y", rev: {HEX40}}}}}
        dest: /src
        """)
    before = _published(envbuild_cli)
    result = envbuild_cli(command, *(["evil"] if command == "build" else []))
    assert not marker.exists(), "git ran the url as --upload-pack"
    _one_line_error(result)
    assert "evil.yaml" in result.err and "git url" in result.err, result.err
    assert _published(envbuild_cli) == before


@pytest.mark.parametrize("url,rev", [
    ("ext::sh -c touch% /tmp/x", "main"),
    ("fd::17", "main"),
    ("https://example.invalid/r.git", "--output=/tmp/x"),
])
def test_git_transports_and_option_revs_are_refused(envbuild_cli, tmp_path, url, rev):
    require_tool("git")
    _write(tmp_path / "envdefs" / "workspaces" / "evil.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: evil
        build_on: busybox-tiny
        source: {{git: {{url: "{url}", rev: "{rev}"}}}}
        dest: /src
        """)
    result = envbuild_cli("validate")
    _one_line_error(result)
    assert "evil.yaml:5" in result.err, result.err


def test_git_itself_refuses_ext_transport(tmp_path):
    """Depth below the allow-list: ``git_env`` makes git refuse ``ext::`` even when called
    with it (a future code path that forgets the check)."""
    require_tool("git")
    from envbuild.build.pin import git_env

    marker = tmp_path / "ran"
    done = subprocess.run(["git", "ls-remote", f"ext::sh -c touch% {marker}"],
                          env=git_env(), capture_output=True, text=True)
    assert done.returncode != 0
    assert not marker.exists()
