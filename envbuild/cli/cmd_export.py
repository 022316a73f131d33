"""``envbuild export``: write a lock as an OCI layout, OCI archive or docker archive for tools
outside envbuild (``envbuild.export``)."""

from __future__ import annotations

import click

from envbuild.cli.main import App, pass_app
from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json
from envbuild.cli.progress import TransferProgress, progress_option


def register(group: click.Group) -> None:
    group.add_command(export)


@click.command()
@click.argument("ref")
@click.option("--to", "to", metavar="TRANSPORT:PATH[:TAG]", required=True,
              help="oci:DIR:TAG, oci-archive:FILE:TAG or docker-archive:FILE:NAME[:TAG] "
                   "(TAG defaults to the env name).")
@click.option("--compression", metavar="zstd|gzip|none", default=None,
              help="Layer compression: zstd copies the lock as is (default for oci and "
                   "oci-archive); gzip and none re-encode the layers (new digests, no "
                   "envbuild TOC; none is the default for docker-archive).")
@progress_option
@json_option("Print the report as JSON.")
@pass_app
def export(app: App, ref: str, to: str, compression: str | None, progress_mode: str,
           as_json: bool) -> None:
    """Write the lock REF (an env name or ref) to --to, for podman, skopeo, umoci,
    docker and containerd."""
    from envbuild.export import ExportRequest, export_lock, parse_target
    from envbuild.store.sync import resolve_ref

    target = parse_target(to)
    shown = TransferProgress.for_stderr("export", progress_mode)
    store = app.open_store()
    report = export_lock(store, ExportRequest(resolve_ref(store, ref), target, compression),
                         meter=shown.meter)
    shown.finish()
    if as_json:
        echo_json({"target": report.target, "tag": report.tag,
                   "manifest": report.manifest_digest, "compression": report.compression,
                   "reencoded": report.reencoded, "layers": [list(p) for p in report.layers],
                   "bytes": report.bytes_written})
    else:
        click.echo(report.summary())
