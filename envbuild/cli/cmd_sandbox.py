"""``envbuild sandbox ls|network|rm|gc``: the sandboxes of this host (``runtime_shim.sdk.sandbox``)."""

from __future__ import annotations

import time

import click

from envbuild.cli.main import App, pass_app
from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json, remove_each


def register(group: click.Group) -> None:
    group.add_command(sandbox)


@click.group()
def sandbox() -> None:
    """Find and clean up sandboxes on this host."""


def _state(s, now: float) -> str:
    return ("expired" if s.expired(now) else "kept" if s.kept
            else "alive" if s.alive else "orphaned")


def sandbox_json(s, now: float) -> dict:
    """One ``SandboxInfo`` of ``sandbox ls --json`` (times: Unix seconds; 0: none)."""
    return {"id": s.id, "backend": s.backend, "state": _state(s, now), "lock": s.lock,
            "pid": s.pid, "alive": s.alive, "kept": s.kept, "created": s.created,
            "expires": s.expires, "lazy": s.lazy, "runtime": s.runtime}


@sandbox.command("ls")
@json_option()
@pass_app
def sandbox_ls(app: App, as_json: bool) -> None:
    """List sandboxes (and whether the process that made them is alive)."""
    from runtime_shim.node import list_sandboxes

    now = time.time()
    found = list_sandboxes(app.settings.node_dir)
    if as_json:
        echo_json({"sandboxes": [sandbox_json(s, now) for s in found]})
        return
    for s in found:
        ttl = f"  expires in {s.expires - now:.0f}s" if s.expires and s.expires > now else ""
        click.echo(f"{s.id}  {s.backend:<9}  {_state(s, now):<8}  {s.lock}{ttl}")


@sandbox.command("network")
@click.argument("sandbox_id", metavar="SANDBOX")
@click.argument("dests", nargs=-1, metavar="[public|CIDR[:PORT]|!CIDR]...")
@click.option("--off", is_flag=True, help="Refuse everything, DNS too.")
@pass_app
def sandbox_network(app: App, sandbox_id: str, dests: tuple[str, ...], off: bool) -> None:
    """Change what a running sandbox may reach, for connections from now on: 'public'
    (the public internet) and CIDR[:PORT] destinations (private ones included); '!CIDR'
    (quoted for the shell) takes a range out of 'public'; none: DNS only. The sandbox must
    have been made with network (--network or --allow)."""
    from envbuild.errors import RuntimeShimError
    from runtime_shim.node import set_sandbox_network

    if off and dests:
        raise RuntimeShimError("--off refuses everything: give it no destinations",
                               hint="envbuild sandbox network ID --off, or ID public ...")
    set_sandbox_network(app.settings.node_dir, sandbox_id, False if off else list(dests))
    click.echo(f"sandbox {sandbox_id} network: " +
               ("off" if off else " ".join(dests) + " + DNS" if dests else "DNS only"))


@sandbox.command("rm")
@click.argument("ids", nargs=-1, required=True)
@json_option()
@pass_app
def sandbox_rm(app: App, ids: tuple[str, ...], as_json: bool) -> int:
    """Kill, unmount and delete sandboxes by id (each one tried; exit 1 if any failed)."""
    from runtime_shim import remove_sandbox

    return remove_each(
        ids, lambda i: remove_sandbox(app.settings.node_dir, i, app.settings.oci_runtime),
        as_json)


@sandbox.command("gc")
@json_option()
@pass_app
def sandbox_gc(app: App, as_json: bool) -> int:
    """Remove sandboxes past their TTL and those left behind by crashed processes (kept
    ones stay until their TTL), and empty sandbox cgroups a crash left (older than five
    minutes, with no sandbox dir on this node): one line per sandbox, removed or failed with its cause;
    one failure never stops the others, and makes the exit code 1."""
    from runtime_shim import sweep_sandboxes

    done = sweep_sandboxes(app.settings.node_dir, app.settings.oci_runtime)
    failed = sum(not r.removed for r in done)
    if as_json:
        echo_json({"removed": [{"id": r.id, "reason": r.reason} for r in done if r.removed],
                   "failed": [{"id": r.id, "reason": r.reason, "error": r.error}
                              for r in done if not r.removed]})
        return 1 if failed else 0
    for r in done:
        click.echo((f"removed {r.id}" + (f" ({r.reason})" if r.reason != "orphaned" else ""))
                   if r.removed else f"failed  {r.id}: {r.error}")
    click.echo(f"removed {len(done) - failed} orphaned or expired sandbox(es) or cgroup(s)" +
               (f", {failed} could not be removed" if failed else ""), err=bool(failed))
    return 1 if failed else 0
