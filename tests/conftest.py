"""Shared test helpers.

Required tools are *required*: a missing ``runc`` or ``zstd`` fails the test that needs it with
the install hint, it never skips silently (``scripts/setup.sh`` installs all of them).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def require_tool(name: str) -> str:
    """Absolute path of ``name`` on PATH, or fail the calling test loudly."""
    path = shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}") else None)
    if path is None:
        pytest.fail(f"required tool {name!r} is not installed; run `bash scripts/setup.sh`",
                    pytrace=False)
    return path


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("this test needs root (mounts, runc); CI and the dev machines run as root",
                    pytrace=False)


@pytest.fixture
def repo_root() -> Path:
    return REPO


from tests.ray_cluster import ray_cluster  # noqa: E402,F401  (session fixture shared by fleet and ray builds)


@pytest.fixture(params=["passthrough", "fuse"])
def lazy_mode(request, monkeypatch) -> str:
    """Each lazy read path in turn: FUSE passthrough, then today's libfuse path (the fallback),
    forced with ``ENVBUILD_LAZY_PASSTHROUGH``; the value is the mode the daemon reports."""
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH",
                       "on" if request.param == "passthrough" else "off")
    return request.param
