"""The ``envbuild`` command: a thin click shell over the library.

One boundary maps errors to exit codes: an ``EnvbuildError`` prints its one-line cause (and
hint) and exits 1; anything else is a bug and exits 2 with a traceback. Each command module
(``cmd_*.py``) defines its commands as module-level click commands, keeps each to parse → one
library call → render, and adds them to the group in ``register(group)``. Options more than one
module takes are in ``options``; every ``--json`` prints through ``output.echo_json``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from pathlib import Path
from typing import Any

import click

from envbuild import __version__
from envbuild.errors import EnvbuildError, bug
from envbuild.settings import TRUSTED_SOURCES_ENV, Settings, check_trusted_sources


@dataclasses.dataclass
class App:
    """What commands share, built once per invocation and kept in ``ctx.obj``."""

    settings: Settings

    def open_store(self, url: str | None = None):
        """Open the store named by the settings, or by ``url`` (push/pull, remote cache)."""
        from envbuild.store import open_store

        return open_store(url or self.settings.store_url, s3_endpoint=self.settings.s3_endpoint,
                          registry_insecure=self.settings.registry_insecure)

    def build_context(self):
        """Store, node cache and OCI runtime for building, from the settings."""
        from envbuild.build.executor import BuildContext
        from envbuild.store import LocalStore
        from runtime_shim.isolation import OciRuntime
        from runtime_shim.node import BudgetSettings, NodeCache, NodeLayout

        store = self.open_store()
        layout = NodeLayout(self.settings.node_dir)
        node = NodeCache(layout.node)
        log_root = (store.root / "logs" if isinstance(store, LocalStore) else layout.logs)
        return BuildContext(store=store, node=node,
                            # Runtime state next to the node's sandboxes (same root as
                            # runtime_shim.sdk.sandbox), not /run/envbuild: per node dir, so test
                            # and CI nodes never see each other's containers, and leftovers of
                            # a killed build are found where the node's other state lives.
                            runtime=OciRuntime(self.settings.oci_runtime,
                                               state_root=str(layout.runc)),
                            scratch_root=layout.builds, log_root=log_root,
                            source_date_epoch=self.settings.source_date_epoch,
                            disk_bytes=self.settings.build_disk_bytes,
                            inodes=self.settings.build_inodes,
                            admission=BudgetSettings.from_env(dict(self.settings.budget_env)),
                            lease_ttl=self.settings.lease_ttl)

    def run_build(self, project, ctx, targets, **kw):
        """Build with SIGTERM treated like Ctrl-C, so both clean up the same way."""
        from envbuild.build.engine import build, install_signal_cancel

        install_signal_cancel(ctx)
        # S3 issue: the remote build cache (--cache-from / --cache-to; envbuild.store.sync)
        if self.settings.cache_from and "cache_from" not in kw:
            kw["cache_from"] = self.open_store(self.settings.cache_from)
        if self.settings.cache_to and "cache_to" not in kw:
            kw["cache_to"] = self.open_store(self.settings.cache_to)
        return build(project, ctx, targets, **kw)


pass_app = click.make_pass_decorator(App)


# Which ``cmd_*`` module registers each top-level command. A command's module (and what it
# imports: networkx, jsonschema, boto3, runtime_shim, ...) is imported only when that command
# runs, or for ``--help``, so ``envbuild --version`` or ``envbuild layer ls`` do not pay for the
# others (issue 12: start-up under 3x a bare interpreter; benchmarks/cli_startup.py).
# tests/unit/test_cli_startup.py checks this table against what the modules register.
COMMAND_MODULES: dict[str, str] = {
    "validate": "cmd_defs",
    "graph": "cmd_plan", "plan": "cmd_plan", "explain": "cmd_plan",
    "build": "cmd_build", "lock": "cmd_build",
    "run": "cmd_run", "check": "cmd_run",
    "pack-diff": "cmd_snapshot", "squash": "cmd_snapshot",
    "grade": "cmd_grade",
    "sandbox": "cmd_sandbox", "node": "cmd_node",
    "layer": "cmd_layer",
    "push": "cmd_sync", "pull": "cmd_sync",
    "job": "cmd_jobs", "gc": "cmd_jobs",
    "export": "cmd_export",
    "fleet": "cmd_fleet",
    "serve": "cmd_serve",
}


class _LazyGroup(click.Group):
    """A group whose commands are registered by their module on first use (click's
    "lazily loading subcommands" pattern, keeping each module's ``register(group)``)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(self.commands) | set(COMMAND_MODULES))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMAND_MODULES:
            load_command_module(COMMAND_MODULES[cmd_name])
        return self.commands.get(cmd_name)


_loaded_modules: set[str] = set()


def load_command_module(name: str) -> None:
    """Import ``envbuild.cli.NAME`` and register its commands on ``cli`` (once)."""
    if name in _loaded_modules:
        return
    _loaded_modules.add(name)
    importlib.import_module(f"envbuild.cli.{name}").register(cli)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--store", "store_url", metavar="DIR|URL", default=None,
              help="Where layers live (default: ./cache, or $ENVBUILD_STORE).")
@click.option("--defs", "defs_dir", metavar="DIR", default=None, type=click.Path(path_type=Path),
              help="Definition tree (default: ./envdefs, or $ENVBUILD_DEFS).")
# S3 issue: endpoint for s3:// stores and the remote build cache (Settings fields)
@click.option("--s3-endpoint", metavar="URL", default=None,
              help="S3 endpoint for s3:// stores (default: $ENVBUILD_S3_ENDPOINT, "
                   "$AWS_ENDPOINT_URL, or AWS).")
@click.option("--cache-from", metavar="URL", default=None,
              help="Remote store a build takes already-built layers from ($ENVBUILD_CACHE_FROM).")
@click.option("--cache-to", metavar="URL", default=None,
              help="Remote store a build pushes its layers and locks to ($ENVBUILD_CACHE_TO).")
# registry issue: docker:// stores on hosts without TLS (loopback ones never need it)
@click.option("--registry-insecure", metavar="HOST", multiple=True,
              help="Speak plain HTTP to this registry host (repeatable; "
                   "$ENVBUILD_REGISTRY_INSECURE, comma-separated).")
# registry issue: which image of a multi-arch index `from: {image: ...}` bases take
@click.option("--platform", metavar="OS/ARCH", default=None,
              help="Platform an image index resolves to for image bases (default: this host's, "
                   "or $ENVBUILD_PLATFORM), e.g. linux/arm64.")
# issue 34 item 5: sources outside the repository are refused unless the operator trusts them
@click.option("--trust-sources", "trusted", metavar="DIR", multiple=True,
              help="Let definitions read sources (rootfs, archives, git repositories, ...) "
                   "under this absolute directory, outside their repository (repeatable; "
                   "$ENVBUILD_TRUSTED_SOURCES, ':'-separated). Only for definitions you trust.")
# The version from envbuild.__version__ (pyproject reads it from there too), not from the
# installed metadata: importlib.metadata costs ~13 ms, more than the rest of --version.
@click.version_option(version=__version__, prog_name="envbuild")
@click.pass_context
def cli(ctx: click.Context, store_url: str | None, defs_dir: Path | None,
        s3_endpoint: str | None, cache_from: str | None, cache_to: str | None,
        registry_insecure: tuple[str, ...], platform: str | None,
        trusted: tuple[str, ...]) -> None:
    """Declarative, content-addressed environments for agent-training sandboxes."""
    if platform is not None:
        if platform.count("/") not in (1, 2) or not all(platform.split("/")):
            raise click.BadParameter(f"{platform!r} is not OS/ARCH[/VARIANT]",
                                     param_hint="--platform")
        # the definitions model reads it when it builds an image source (defs.model.host_platform)
        os.environ["ENVBUILD_PLATFORM"] = platform
    if trusted:
        # what pinning reads (envbuild.build.pin.Pinner), as --platform: every command sees it
        os.environ[TRUSTED_SOURCES_ENV] = os.pathsep.join(check_trusted_sources(trusted))
    settings = Settings.from_env(os.environ)
    if store_url is not None:
        settings = dataclasses.replace(settings, store_url=store_url)
    if defs_dir is not None:
        settings = dataclasses.replace(settings, defs_dir=defs_dir)
    overrides: dict[str, Any] = {
        k: v for k, v in (("s3_endpoint", s3_endpoint), ("cache_from", cache_from),
                          ("cache_to", cache_to)) if v is not None}
    if overrides:
        settings = dataclasses.replace(settings, **overrides)
    if registry_insecure:
        settings = dataclasses.replace(settings, registry_insecure=registry_insecure)
    ctx.obj = App(settings=settings)


def report_error(err: EnvbuildError) -> None:
    for line in err.render_lines():
        click.echo(line, err=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI and map errors to exit codes (1 = user error, 2 = bug)."""
    try:
        result = cli.main(args=argv, prog_name="envbuild", standalone_mode=False)
    except EnvbuildError as err:
        report_error(err)
        return 1
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as err:
        err.show()
        return err.exit_code
    except click.exceptions.Exit as err:
        return err.exit_code
    except BrokenPipeError:
        return 0
    except Exception:  # noqa: BLE001 - the one place unknown errors become exit code 2
        import traceback

        traceback.print_exc()
        click.echo(str(bug("unexpected error")), err=True)
        return 2
    return result if isinstance(result, int) else 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
