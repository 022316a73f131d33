"""``lazy=`` checked before anything is made (``runtime_shim.sdk.options.lazy_mode``): the
modes, ``lazy="fuse"`` and the removed FUSE stacks' switches refused in one line, and
checkpointable lazy sandboxes turned into full pulls (CRIU cannot dump files of the native
layers)."""

from __future__ import annotations

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.sdk.options import FUSE_SWITCHES, SandboxOptions, lazy_mode


@pytest.mark.parametrize("lazy", [False, True, "auto", "native"])
def test_the_modes_pass_unchanged_with_no_switch_set(lazy):
    assert lazy_mode(SandboxOptions(lazy=lazy), {}) == (lazy, "")


def test_an_unknown_mode_is_refused_in_one_line():
    with pytest.raises(RuntimeShimError,
                       match="lazy must be False, True, 'auto' or 'native', not 'yes'"):
        lazy_mode(SandboxOptions(lazy="yes"), {})


@pytest.mark.parametrize("lazy", [True, "auto", "native"])
@pytest.mark.parametrize("switch", FUSE_SWITCHES)
def test_a_fuse_switch_is_refused_with_a_lazy_mode(lazy, switch):
    with pytest.raises(RuntimeShimError, match="switch of the FUSE lazy stacks, which were "
                                               "removed") as err:
        lazy_mode(SandboxOptions(lazy=lazy), {switch: "on", "ENVBUILD_LAZY_OPEN_TRACE": "/t"})
    assert err.value.message.startswith(switch) and "\n" not in err.value.message
    assert f"unset {switch}" in (err.value.hint or "")


def test_lazy_fuse_is_refused_in_one_line_with_a_hint():
    """The FUSE stacks are gone (issue 36): ``lazy="fuse"`` says so, with or without a
    switch set, and points at the native modes."""
    for env in ({}, dict.fromkeys(FUSE_SWITCHES, "on")):
        with pytest.raises(RuntimeShimError, match="lazy='fuse' is gone") as err:
            lazy_mode(SandboxOptions(lazy="fuse"), env)
        assert "\n" not in err.value.message and "lazy=True" in (err.value.hint or "")


def test_fuse_switches_are_left_alone_without_a_lazy_mode():
    env = dict.fromkeys(FUSE_SWITCHES, "on")
    assert lazy_mode(SandboxOptions(lazy=False), env) == (False, "")


def test_an_empty_switch_counts_as_unset():
    assert lazy_mode(SandboxOptions(lazy=True), {"ENVBUILD_LAZY_PASSTHROUGH": ""}) == (True, "")


@pytest.mark.parametrize("lazy", [True, "auto"])
def test_a_checkpointable_lazy_sandbox_becomes_a_full_pull_said_once(lazy, caplog):
    with caplog.at_level("WARNING", logger="envbuild.sandbox"):
        got, note = lazy_mode(SandboxOptions(lazy=lazy, checkpointable=True), {})
    assert got is False and note.startswith("full pull: a checkpointable sandbox")
    assert len([r for r in caplog.records if r.name == "envbuild.sandbox"]) == 1


def test_a_checkpointable_native_sandbox_is_refused():
    with pytest.raises(RuntimeShimError, match="cannot be checkpointed") as err:
        lazy_mode(SandboxOptions(lazy="native", checkpointable=True), {})
    assert "lazy=False" in (err.value.hint or "")
