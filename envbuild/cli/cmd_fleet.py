"""``envbuild fleet start|ls|nodes|rm|gc|stop``: sandbox fleets on a Ray cluster
(``runtime_shim.fleet``), and the ``job run FILE --fleet ADDRESS`` helper of ``cmd_jobs``.

``--address`` is the Ray cluster (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``; default
``$ENVBUILD_FLEET``, else ``auto``); the store is the global ``--store`` (every node must read
it: ``s3://…``, or a directory on a one-host cluster). Ray is imported only when a command
runs.
"""

from __future__ import annotations

import os
import time
from typing import Any

import click

from envbuild.cli.main import App, pass_app
from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json, remove_each


def _address(value: str | None) -> str:
    return value or os.environ.get("ENVBUILD_FLEET") or "auto"


def connect(app: App, address: str | None, *, start: bool = False, **options: Any):
    """A ``Fleet`` on the cluster at ``address`` with the settings' store."""
    from runtime_shim.fleet import Fleet

    return Fleet.connect(address=_address(address), store=app.settings.store_url,
                         s3_endpoint=app.settings.s3_endpoint, start=start, **options)


def _record_json(r) -> dict[str, Any]:
    return {"id": r.id, "node": r.node_id, "lock": r.lock, "backend": r.backend,
            "created": r.created, "lease_expires": r.lease_expires, "exec_log": r.exec_log,
            "labels": dict(r.labels)}


address_option = click.option("--address", default=None,
                              help="Ray cluster address (default: $ENVBUILD_FLEET, else auto).")


def register(group: click.Group) -> None:
    group.add_command(fleet)


@click.group("fleet")
def fleet() -> None:
    """Sandboxes across a Ray cluster's envbuild_node nodes."""


@fleet.command("start")
@address_option
@click.option("--node-dir", default="/var/lib/envbuild/fleet/{node_id}", show_default=True,
              help="Each daemon's node dir; {node_id} is its Ray node id.")
@click.option("--slots", type=click.IntRange(1), default=256, show_default=True,
              help="Sandboxes per node.")
@click.option("--max-starting", type=click.IntRange(1), default=4, show_default=True,
              help="Sandboxes a node starts at once (more wait in its queue).")
@click.option("--workers", type=click.IntRange(0), default=0, show_default=True,
              help="Processes that run each node's starts (0: the daemon's threads).")
@click.option("--data-host", default=None, metavar="ADDRESS",
              help="Serve exec and files on this address (a token per sandbox); "
                   "default: over Ray only.")
@json_option()
@pass_app
def fleet_start(app: App, address: str | None, node_dir: str, slots: int,
                max_starting: int, workers: int, data_host: str | None,
                as_json: bool) -> None:
    """Start a node daemon on every node offering envbuild_node (idempotent)."""
    f = connect(app, address, start=True, node_dir=node_dir, slots=slots,
                max_starting=max_starting, workers=workers, data_host=data_host)
    if as_json:
        echo_json({"nodes": list(f.node_ids), "store": f.store_url})
    else:
        click.echo(f"{len(f.node_ids)} node daemon(s) running, store {f.store_url}")


@fleet.command("nodes")
@address_option
@json_option("Print JSON.")
@pass_app
def fleet_nodes(app: App, address: str | None, as_json: bool) -> None:
    """Each node's capacity and load."""
    nodes = connect(app, address).nodes()
    if as_json:
        echo_json([{"node": n.node_id, "slots": n.slots, "used": n.used,
                    "starting": n.starting, "queued": n.queued, "warm": n.warm,
                    "memory_bytes": n.memory_bytes, "memory_used": n.memory_used,
                    "pulled_bytes": n.pulled_bytes, "node_dir": n.node_dir} for n in nodes])
        return
    for n in nodes:
        click.echo(f"{n.node_id[:12]}  {n.used}/{n.slots} sandboxes  {n.starting} starting"
                   f"  {n.queued} queued  {n.warm} warm  "
                   f"{n.memory_used >> 20}/{n.memory_bytes >> 20} MiB  {n.node_dir}")


@fleet.command("ls")
@address_option
@json_option("Print JSON.")
@pass_app
def fleet_ls(app: App, address: str | None, as_json: bool) -> None:
    """Every live sandbox of the fleet."""
    records = connect(app, address).list()
    if as_json:
        echo_json([_record_json(r) for r in records])
        return
    now = time.time()
    for r in records:
        left = f"  lease {r.lease_expires - now:.0f}s" if r.lease_expires else ""
        click.echo(f"{r.id}  {r.backend:<9}  {r.lock}{left}")


@fleet.command("rm")
@click.argument("ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Every sandbox of the fleet.")
@address_option
@json_option()
@pass_app
def fleet_rm(app: App, ids: tuple[str, ...], all_: bool, address: str | None,
             as_json: bool) -> int:
    """Close sandboxes by fleet id (each one tried; exit 1 if any failed), or --all."""
    if not ids and not all_:
        raise click.UsageError("name sandbox ids, or pass --all")
    f = connect(app, address)
    if all_:
        closed = f.close_all()
        if as_json:
            echo_json({"removed": list(closed), "failed": []})
        else:
            for i in closed:
                click.echo(f"removed {i}")
        return 0
    return remove_each(ids, lambda i: f.attach(i).close(), as_json)


@fleet.command("gc")
@address_option
@json_option()
@pass_app
def fleet_gc(app: App, address: str | None, as_json: bool) -> None:
    """Remove sandboxes past their lease and node-dir leftovers nobody owns."""
    removed = connect(app, address).gc()
    if as_json:
        echo_json({"removed": list(removed)})
        return
    for i in removed:
        click.echo(f"removed {i}")
    click.echo(f"{len(removed)} removed", err=True)


@fleet.command("stop")
@address_option
@json_option()
@pass_app
def fleet_stop(app: App, address: str | None, as_json: bool) -> None:
    """Close every sandbox and stop every node daemon."""
    closed = connect(app, address).stop_daemons()
    if as_json:
        echo_json({"closed": list(closed)})
    else:
        click.echo(f"{len(closed)} sandbox(es) closed, daemons stopped")


def job_run(app: App, file, address: str | None, as_json: bool, ttl: float | None) -> None:
    """``envbuild job run FILE --fleet ADDRESS``: every group of a resolved manifest."""
    from envbuild.jobs import load_job_manifest

    manifest = load_job_manifest(file)
    f = connect(app, address)
    made = f.create_groups(manifest.groups, **({"ttl": ttl} if ttl else {}))
    if as_json:
        echo_json({"groups": [
            {"group": g.label, "lock": g.lock, "task": g.task,
             "sandboxes": [s.id for s in handles]}
            for g, handles in zip(manifest.groups, made, strict=True)]})
        return
    for g, handles in zip(manifest.groups, made, strict=True):
        for s in handles:
            click.echo(f"{s.id}  {g.label}")
