"""``envbuild pack-diff`` (a running sandbox's changes as a layer and a derived lock) and
``envbuild squash`` (a lock's snapshot layers merged into one)."""

from __future__ import annotations

import click

from envbuild.cli.main import App, pass_app
from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json
from envbuild.sizes import human_size


def register(group: click.Group) -> None:
    group.add_command(pack_diff)
    group.add_command(squash)


@click.command("pack-diff")
@click.argument("sandbox_id", metavar="SANDBOX")
@click.option("--publish", "ref", metavar="REF", help="Ref for the snapshot's lock, e.g. snap/NAME.")
@click.option("--max-file-size", default="1G", show_default=True, metavar="SIZE",
              help="Refuse the snapshot if one file is larger.")
@click.option("--max-total-size", default=None, metavar="SIZE",
              help="Refuse the snapshot if the changes add up to more (apparent sizes: "
                   "sparse files count in full)  [default: the sandbox's disk limit, 10G]")
@json_option("Print the result and every policy decision as JSON.")
@pass_app
def pack_diff(app: App, sandbox_id: str, ref: str | None, max_file_size: str,
              max_total_size: str, as_json: bool) -> None:
    """Snapshot a running sandbox (envbuild run --keep) as a layer + derived lock."""
    from envbuild.sizes import parse_size
    from runtime_shim import Sandbox
    from runtime_shim.node import SnapshotPolicy

    sb = Sandbox.attach(sandbox_id, store=app.open_store(), node_dir=app.settings.node_dir,
                        runtime=app.settings.oci_runtime)
    total = ({} if max_total_size is None
             else {"max_total_bytes": parse_size(max_total_size, what="--max-total-size")})
    # an attached sandbox's limits are not recorded: for_limits falls back to the default
    max_file = parse_size(max_file_size, what="--max-file-size")
    policy = SnapshotPolicy.for_limits(None, max_file_bytes=max_file, **total)
    result = sb.pack_diff(ref, policy=policy, source_date_epoch=app.settings.source_date_epoch)
    if as_json:
        echo_json(result.to_json())
        return
    click.echo(f"layer {result.layer} ({human_size(result.size)}, {result.seconds:.2f}s)")
    click.echo(f"lock  {result.lock}" + (f" as {ref}" if ref else "")
               + (" (snapshot chain squashed)" if result.squashed else ""))
    for d in result.report.decisions:
        click.echo(f"policy: {d['action']} {d['path']}: {d['reason']}", err=True)


@click.command()
@click.argument("ref")
@click.option("--publish", "new_ref", metavar="REF2", required=True, help="Ref for the squashed lock.")
@json_option()
@pass_app
def squash(app: App, ref: str, new_ref: str, as_json: bool) -> None:
    """Merge the snapshot layers at the top of REF's lock into one layer."""
    from runtime_shim.node import resolve, squash_snapshots

    store = app.open_store()
    from runtime_shim.node import NodeLayout

    scratch = NodeLayout(app.settings.node_dir).builds
    scratch.mkdir(parents=True, exist_ok=True)
    lock = resolve(store, ref)
    digest = squash_snapshots(store, lock, scratch=scratch, ref=new_ref)
    if digest is None:
        store.put_ref(new_ref, lock.digest)
    if as_json:
        echo_json({"ref": new_ref, "digest": digest or lock.digest, "squashed": digest is not None})
    elif digest is None:
        click.echo(f"{new_ref} {lock.digest} (nothing to squash: at most one snapshot layer)")
    else:
        click.echo(f"{new_ref} {digest}")
