"""``envbuild node ls|gc``: this host's node cache (``runtime_shim.node.nodecache``) and its
native lazy layers and filler (``runtime_shim.lazyfs.native``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from envbuild.cli.main import App, pass_app
from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json
from envbuild.sizes import human_size


def register(group: click.Group) -> None:
    group.add_command(node)


@click.group()
def node() -> None:
    """This host's node cache: unpacked layers shared by builds and sandboxes."""


def node_report(node_dir: Path) -> dict[str, Any]:
    """What ``node ls`` shows, as data (the ``--json`` document): the unpacked layers and the
    native lazy layers' and filler's lines (``runtime_shim.lazyfs.native.describe_native``)."""
    from runtime_shim.lazyfs import describe_native
    from runtime_shim.node import NodeCache, NodeLayout

    cache = NodeCache(NodeLayout(node_dir).node)
    layers = cache.usage()
    report: dict[str, Any] = {
        "layers": [{"digest": u.digest, "size": u.size, "last_used": u.last_used}
                   for u in layers],
        "bytes": sum(u.size for u in layers), "native": describe_native(cache.root)}
    if (cache.root / "objects").is_dir():
        from runtime_shim.lazyfs import describe_objects

        report["objects"] = describe_objects(str(cache.root))
    return report


@node.command("ls")
@json_option()
@pass_app
def node_ls(app: App, as_json: bool) -> None:
    """List unpacked layers with their size and last use, then the native lazy layers and
    the node's filler."""
    report = node_report(app.settings.node_dir)
    if as_json:
        echo_json(report)
        return
    for u in report["layers"]:
        click.echo(f"{u['digest']}  {human_size(u['size']):>9}  "
                   f"last used {time.ctime(u['last_used'])}")
    click.echo(f"{len(report['layers'])} layers, {human_size(report['bytes'])}")
    for line in report["native"]:
        click.echo(line)


@node.command("gc")
@click.option("--max-size", default=None, metavar="SIZE",
              help="Keep at most this much (e.g. 20G, 500M, 10%); 0 evicts every unused "
                   "layer.  [default: the node cache budget, $ENVBUILD_NODE_CACHE_MAX or "
                   "20% of its filesystem, at most 50G]")
@click.option("--objects-max", default=None, metavar="SIZE",
              help="Also empty idle objects of mounted native layers (no file of theirs "
                   "open), least recently read first, until the native object store holds "
                   "at most this much (e.g. 5G; 0 empties every idle one); they are filled "
                   "again on their next open.  [default: only objects no mounted layer "
                   "uses are removed]")
@json_option()
@pass_app
def node_gc(app: App, max_size: str | None, objects_max: str | None, as_json: bool) -> None:
    """Evict least recently used layers that no live sandbox uses until the node cache
    is within its budget (and unmount unused native lazy layers); remove the native objects
    no mounted layer uses."""
    from envbuild.build.executor import sweep_stale_scratch
    from envbuild.settings import node_cache_budget
    from envbuild.sizes import parse_size
    from runtime_shim.isolation import OciRuntime
    from runtime_shim.lazyfs import collect_objects
    from runtime_shim.node import NodeCache, NodeLayout, layers_in_use

    layout = NodeLayout(app.settings.node_dir)
    budget = node_cache_budget(max_size or app.settings.node_cache_max, app.settings.node_dir)
    objects_budget = None if objects_max is None else parse_size(objects_max,
                                                                  what="--objects-max")
    keep = layers_in_use(layout)
    evicted = NodeCache(layout.node).evict(keep, budget)
    objects = collect_objects(str(layout.node), objects_budget)
    swept = sweep_stale_scratch(layout.builds,
                                OciRuntime(app.settings.oci_runtime, state_root=str(layout.runc)))
    if as_json:
        echo_json({"evicted": list(evicted), "budget": budget, "in_use": sorted(keep),
                   "scratch_removed": [str(p) for p in swept], "objects": objects})
        return
    click.echo(f"evicted {len(evicted)} layer(s) (budget {human_size(budget)}); "
               f"{len(keep)} in use by live sandboxes kept")
    if objects:
        click.echo(objects_line(objects))
    if swept:
        click.echo(f"removed {len(swept)} scratch dir(s) of killed builds")


def objects_line(done: dict[str, Any]) -> str:
    """``node gc``'s line on the native object store (``collect_objects``' result)."""
    line = (f"native objects: {done.get('unlinked', 0)} removed "
            f"({human_size(done.get('unlinked_bytes', 0))})")
    if "emptied" in done:
        line += (f", {done['emptied']} emptied ({human_size(done['emptied_bytes'])}), "
                 f"{done['busy']} busy kept")
    why = done.get("skipped") or done.get("shrink_skipped") or done.get("shrink_stopped")
    return line + (f" ({why})" if why else "")
