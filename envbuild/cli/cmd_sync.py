"""``envbuild push`` / ``envbuild pull``: copy locks, their layers and key records between stores.

Refs are published last, only after everything they point to is in the destination
(``envbuild.store.sync``)."""

from __future__ import annotations

import click

from envbuild.cli.main import App, pass_app
from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json
from envbuild.cli.progress import TransferProgress, progress_option


def _render(report, as_json: bool) -> None:
    if as_json:
        echo_json({"refs": report.refs, "blobs_copied": report.blobs_copied,
                   "bytes_copied": report.bytes_copied, "blobs_present": report.blobs_present,
                   "records_copied": report.records_copied})
        return
    for name, digest in report.refs.items():
        click.echo(f"{name} {digest}")
    click.echo(report.summary(), err=True)


jobs_option = click.option("--jobs", "-j", type=click.IntRange(1), default=4, show_default=True,
                           help="Blobs copied at once.")


def register(group: click.Group) -> None:
    group.add_command(push)
    group.add_command(pull)


@click.command()
@click.argument("refs", nargs=-1)
@click.option("--to", "to_url", metavar="URL", required=True,
              help="Destination store (a directory, s3://BUCKET/PREFIX or "
                   "docker://HOST[:PORT]/REPO).")
@jobs_option
@click.option("--compression", metavar="zstd|gzip|none", default="zstd", show_default=True,
              help="Layer compression: zstd copies the locks as they are; gzip and none "
                   "re-encode their layers (new digests, no envbuild TOC, key records not "
                   "pushed) for tools that cannot read zstd, e.g. docker 20.10.")
@progress_option
@json_option("Print the report as JSON.")
@pass_app
def push(app: App, refs: tuple[str, ...], to_url: str, jobs: int, compression: str,
         progress_mode: str, as_json: bool) -> None:
    """Copy REFS (env names or refs, NAME@DIGEST: only if it still has that digest;
    default: every ref) with their layers to --to."""
    from envbuild.store.recompress import check_compression
    from envbuild.store.sync import resolve_ref, split_pin, sync

    check_compression(compression)
    shown = TransferProgress.for_stderr("push", progress_mode)
    src = app.open_store()
    pinned = [split_pin(r) for r in refs]
    names = [resolve_ref(src, n) for n, _ in pinned] if refs else src.list_refs()
    pins = {name: d for name, (_, d) in zip(names, pinned) if d}
    report = sync(src, app.open_store(to_url), refs=names, jobs=jobs, pins=pins,
                  compression=compression, meter=shown.meter)
    shown.finish()
    _render(report, as_json)


@click.command()
@click.argument("refs", nargs=-1, required=True)
@click.option("--from", "from_url", metavar="URL", required=True,
              help="Source store (a directory, s3://BUCKET/PREFIX or "
                   "docker://HOST[:PORT]/REPO).")
@jobs_option
@progress_option
@json_option("Print the report as JSON.")
@pass_app
def pull(app: App, refs: tuple[str, ...], from_url: str, jobs: int, progress_mode: str,
         as_json: bool) -> None:
    """Copy REFS (env names or refs, NAME@DIGEST: only if it still has that digest) with
    their layers from --from into the store."""
    from envbuild.store.sync import resolve_ref, split_pin, sync

    shown = TransferProgress.for_stderr("pull", progress_mode)
    src = app.open_store(from_url)
    pinned = [split_pin(r) for r in refs]
    names = [resolve_ref(src, n) for n, _ in pinned]
    pins = {name: d for name, (_, d) in zip(names, pinned) if d}
    report = sync(src, app.open_store(), refs=names, jobs=jobs, pins=pins, meter=shown.meter)
    shown.finish()
    _render(report, as_json)
