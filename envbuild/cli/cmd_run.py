"""``envbuild run`` (a command in a fresh sandbox) and ``envbuild check`` (the workspaces'
checks); pack-diff and squash are in ``cmd_snapshot``, ``sandbox`` in ``cmd_sandbox``, ``node``
in ``cmd_node``."""

from __future__ import annotations

import sys

import click

from envbuild.cli.main import App, pass_app
from envbuild.cli.options import backend_option, json_option
from envbuild.cli.output import echo_json


def register(group: click.Group) -> None:
    group.add_command(run)
    group.add_command(check)


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("target")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--network", is_flag=True,
              help="Give the sandbox egress to the public internet through its own NATed "
                   "network namespace (the host and private ranges stay unreachable).")
@click.option("--allow", "allow", multiple=True, metavar="CIDR[:PORT]|public",
              help="With --network (implied): egress only to these destinations, private "
                   "ones included, and to the public internet with 'public' (repeatable; "
                   "DNS is always allowed).")
@click.option("--keep", is_flag=True, help="Leave the sandbox running; print its id.")
@click.option("--timeout", type=float, default=None, help="Kill CMD after this many seconds.")
@click.option("--lazy", is_flag=True,  # lazy mode (runtime_shim.lazyfs.native)
              help="Start at once instead of pulling and unpacking the layers: the kernel "
                   "serves each layer's metadata and a root filler fills each file from the "
                   "store when it is first opened (fanotify pre-content events: Linux >= "
                   "6.14, root); where the host cannot, a full pull with a warning.")
@click.option("--lazy-native", is_flag=True,  # runtime_shim.lazyfs.native
              help="As --lazy, but refused in one line where the host cannot (no full pull).")
@backend_option()
@pass_app
def run(app: App, target: str, cmd: tuple[str, ...], network: bool, allow: tuple[str, ...],
        keep: bool, timeout: float | None, lazy: bool, lazy_native: bool, backend: str) -> int:
    """Run CMD in a fresh sandbox of TARGET (env name, ref or lock digest); builds nothing."""
    from runtime_shim import Sandbox

    # keep with a microVM or fncall: refused by the backend itself (BackendUnavailable)
    sb = Sandbox.create(target, store=app.open_store(), node_dir=app.settings.node_dir,
                        backend=backend, network=list(allow) if allow else network,
                        runtime=app.settings.oci_runtime,
                        keep=keep, lazy="native" if lazy_native else lazy)
    try:
        result = sb.exec(list(cmd), timeout=timeout)
    finally:
        if not keep:
            sb.close()
    sys.stdout.buffer.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(result.stderr)
    if result.timed_out:
        click.echo(f"envbuild: command timed out after {timeout}s", err=True)
    if keep:
        click.echo(f"sandbox {sb.id} kept; remove it with `envbuild sandbox rm {sb.id}`",
                   err=True)
    return result.exit_code


@click.command()
@click.argument("envs", nargs=-1)
@click.option("--jobs", "-j", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Envs checked at once, each in its own sandbox.")
@json_option("Print every command's result as one JSON document at the end (no blocks).")
@pass_app
def check(app: App, envs: tuple[str, ...], jobs: int, as_json: bool) -> int:
    """Run each env's workspace checks in a sandbox over its lock.

    Prints one block per env as it finishes: a line per command (ok with the test
    runner's summary line, or FAIL with its exit code or deadline and its output's tail),
    then the env's result; the last line counts every command. Exit 1 if any failed."""
    from envbuild.build.check import run_checks
    from envbuild.build.engine import load

    results = run_checks(load(app.settings.defs_dir), app.open_store(),
                         app.settings.node_dir, envs or None, runtime=app.settings.oci_runtime,
                         jobs=jobs, on_env=None if as_json else _print_env)
    failed = sum(not r.ok for r in results)
    if as_json:
        echo_json({"results": [check_json(r) for r in results],
                   "passed": len(results) - failed, "failed": failed})
    else:
        click.echo(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


def check_json(r) -> dict:
    """One ``CheckResult`` of ``check --json`` (``tail``: the output's last lines)."""
    return {"env": r.env, "workspace": r.workspace, "command": r.command, "ok": r.ok,
            "exit_code": r.exit_code, "timed_out": r.timed_out,
            "timeout": r.timeout or None, "seconds": round(r.seconds, 3),
            "summary": r.summary, "tail": r.tail}


def _print_env(env: str, results) -> None:
    """One env's block of ``envbuild check`` output (see ``check``)."""
    for r in results:
        if r.ok:
            summary = f"  [{r.summary}]" if r.summary else ""
            click.echo(f"ok   {r.env:<20} {r.workspace:<16} {r.command}  ({r.seconds:.1f}s)"
                       f"{summary}")
            continue
        why = (f"timed out after {r.timeout:g}s" if r.timed_out
               else f"exit {r.exit_code}, {r.seconds:.1f}s")
        click.echo(f"FAIL {r.env:<20} {r.workspace:<16} {r.command}  ({why})")
        tail = r.tail
        click.echo("\n".join("     | " + line for line in tail) if tail
                   else "     | (no output)")
    bad = sum(not r.ok for r in results)
    total = sum(r.seconds for r in results)
    click.echo(f"env {env}: {'FAILED' if bad else 'ok'} ({len(results) - bad}/{len(results)} "
               f"checks passed, {total:.1f}s)")
