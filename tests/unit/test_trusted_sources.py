"""The operator's opt-in for sources outside a definition tree's repository (issue 34, item 5):
``ENVBUILD_TRUSTED_SOURCES`` / ``--trust-sources``, parsed at the edge."""

from __future__ import annotations

import pytest

from envbuild.errors import SettingsError
from envbuild.settings import Settings, check_trusted_sources, trusted_sources


def test_nothing_is_trusted_by_default():
    assert trusted_sources({}) == ()
    assert Settings.from_env({}).trusted_sources == ()
    assert trusted_sources({"ENVBUILD_TRUSTED_SOURCES": ""}) == ()


def test_absolute_directories_are_normalised_and_empty_entries_dropped():
    env = {"ENVBUILD_TRUSTED_SOURCES": "/srv/images/::/opt/./roots//x"}
    assert trusted_sources(env) == ("/srv/images", "/opt/roots/x")
    assert Settings.from_env(env).trusted_sources == ("/srv/images", "/opt/roots/x")


@pytest.mark.parametrize("path", ["relative", "./x", "../etc", "~/x"])
def test_a_relative_directory_is_refused(path):
    with pytest.raises(SettingsError, match="not an absolute path"):
        check_trusted_sources([path])
    with pytest.raises(SettingsError):
        Settings.from_env({"ENVBUILD_TRUSTED_SOURCES": f"/ok:{path}"})
