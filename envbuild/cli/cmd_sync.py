"""``envbuild push`` / ``envbuild pull``: copy locks, their layers and key records between stores.

Refs are published last, only after everything they point to is in the destination
(``envbuild.store.sync``)."""

from __future__ import annotations

import json

import click

from envbuild.cli.main import App, pass_app


def _render(report, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"refs": report.refs, "blobs_copied": report.blobs_copied,
                               "bytes_copied": report.bytes_copied,
                               "blobs_present": report.blobs_present,
                               "records_copied": report.records_copied}, indent=1))
        return
    for name, digest in report.refs.items():
        click.echo(f"{name} {digest}")
    click.echo(report.summary(), err=True)


def register(group: click.Group) -> None:
    @group.command()
    @click.argument("refs", nargs=-1)
    @click.option("--to", "to_url", metavar="URL", required=True,
                  help="Destination store (s3://BUCKET/PREFIX or a directory).")
    @click.option("--jobs", "-j", type=click.IntRange(1), default=4, show_default=True,
                  help="Blobs copied at once.")
    @click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
    @pass_app
    def push(app: App, refs: tuple[str, ...], to_url: str, jobs: int, as_json: bool) -> None:
        """Copy REFS (env names or refs; default: every ref) with their layers to --to."""
        from envbuild.store.sync import resolve_ref, sync

        src = app.open_store()
        names = [resolve_ref(src, r) for r in refs] if refs else src.list_refs()
        _render(sync(src, app.open_store(to_url), refs=names, jobs=jobs), as_json)

    @group.command()
    @click.argument("refs", nargs=-1, required=True)
    @click.option("--from", "from_url", metavar="URL", required=True,
                  help="Source store (s3://BUCKET/PREFIX or a directory).")
    @click.option("--jobs", "-j", type=click.IntRange(1), default=4, show_default=True,
                  help="Blobs copied at once.")
    @click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
    @pass_app
    def pull(app: App, refs: tuple[str, ...], from_url: str, jobs: int, as_json: bool) -> None:
        """Copy REFS (env names or refs) with their layers from --from into the store."""
        from envbuild.store.sync import resolve_ref, sync

        src = app.open_store(from_url)
        names = [resolve_ref(src, r) for r in refs]
        _render(sync(src, app.open_store(), refs=names, jobs=jobs), as_json)
