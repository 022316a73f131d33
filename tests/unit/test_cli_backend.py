"""``envbuild run --backend`` accepts every backend the SDK accepts (``runtime_shim.backends.base``'s
registry: the built-in ones and any registered since), and nothing else."""

from __future__ import annotations

import click
import pytest

from envbuild.cli.main import main
from envbuild.cli.options import BackendName, backend_names
from runtime_shim.backends import base as backend_registry


def test_the_cli_reads_the_sdk_registry():
    assert backend_names() == backend_registry.backend_names()
    assert {"container", "microvm", "fncall"} <= set(backend_names())


def test_run_help_lists_every_backend(capsys):
    assert main(["run", "--help"]) == 0
    assert "--backend [container|fncall|microvm]" in capsys.readouterr().out


def test_an_unknown_backend_is_a_usage_error_naming_the_choices(capsys):
    assert main(["run", "--backend", "nosuch", "env", "true"]) == 2
    err = capsys.readouterr().err
    assert "'nosuch' is not a sandbox backend; choose one of: container, fncall, microvm" in err


def test_a_registered_backend_is_accepted():
    with pytest.raises(click.BadParameter):
        BackendName().convert("fake-for-cli", None, None)
    backend_registry.register("fake-for-cli", lambda: None)  # type: ignore[arg-type, return-value]
    try:
        assert BackendName().convert("fake-for-cli", None, None) == "fake-for-cli"
    finally:
        backend_registry.unregister("fake-for-cli")
