"""``docs/cli.md`` is what ``python -m envbuild.cli.docgen`` makes of the click commands: a
change to a command, an option or a help text that is not regenerated fails here."""

from __future__ import annotations

import difflib

import click

import runtime_shim.backends.base  # noqa: F401  (see below)
from envbuild.cli import docgen
from envbuild.cli.main import cli

# ``--backend``'s metavar lists runtime_shim.backends.base's registry, and importing that module
# imports envbuild.safefs, whose libc lookup (ctypes.util.find_library) runs ldconfig: done
# here, at collection, not inside a test where tests/unit/conftest.py refuses subprocesses.


def test_docs_cli_md_is_up_to_date():
    want = docgen.render()
    have = docgen.DOC.read_text(encoding="utf-8") if docgen.DOC.exists() else ""
    diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                        "docs/cli.md", "generated", n=1))
    assert have == want, ("docs/cli.md is out of date: run python -m envbuild.cli.docgen "
                          "and commit it\n" + diff[:4000])


def test_the_reference_has_every_command_and_option():
    text = docgen.render()
    seen = 0
    for cmd, ctx in docgen._commands(cli, click.Context(cli, info_name="envbuild")):
        assert f"\n## {ctx.command_path}\n" in text
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                assert any(f"`{o}" in text or f", {o}" in text for o in p.opts), p.opts
        seen += 1
    assert seen > 40


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "cli.md"
    stale.write_text("old\n")
    assert docgen.main(["--check", "-o", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert docgen.main(["-o", str(stale)]) == 0
    assert docgen.main(["--check", "-o", str(stale)]) == 0
