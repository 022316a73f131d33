"""Attacks against envbuild, each reproduced against the real component (runc, the real
importers, the real agent) with the secure outcome asserted.

Every test here is an integration test: the attacks need root, runc, overlayfs and the agent.
A missing tool fails the test loudly (``tests.conftest.require_tool``), it never skips.
The fixtures of ``tests/integration`` are shared (``envbuild_cli``, ``build_busybox_env``).
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import *  # noqa: F401,F403  (shared fixtures)


@pytest.fixture(scope="session")
def busybox_store(tmp_path_factory):
    """One built busybox env (``env/busybox-shell``) for every security test of the session:
    ``(LocalStore, node_dir)``. Tests that need a sandbox create their own from it."""
    from tests.integration.conftest import build_busybox_env

    return build_busybox_env(tmp_path_factory.mktemp("security-env"))
