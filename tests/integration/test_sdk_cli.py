"""``envbuild sandbox ls|rm`` and ``run --keep --backend microvm`` as the SDK's rules say."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_sandbox_rm_unknown_id_and_ls(envbuild_cli):
    r = envbuild_cli("sandbox", "rm", "eb-0123456789ab")
    assert r.code == 1
    assert "removed" not in r.out and "no sandbox eb-0123456789ab" in r.out
    assert envbuild_cli("sandbox", "ls").code == 0


def test_keep_with_a_microvm_is_refused_by_the_library(envbuild_cli):
    assert envbuild_cli("build").code == 0
    r = envbuild_cli("run", "--keep", "--backend", "microvm", "busybox-shell", "true")
    assert r.code == 1
    assert r.err.startswith("error: ") and "Traceback" not in r.err
    sandboxes = envbuild_cli.node / "sandboxes"
    assert not sandboxes.exists() or not any(sandboxes.iterdir())
