"""``envbuild job resolve|verify`` (training-job manifests, ``envbuild.jobs``) and
``envbuild gc`` (store garbage collection, ``envbuild.store.gc``).

Both take ``--store URL`` after the command as well as before it (``envbuild --store URL gc``).
"""

from __future__ import annotations

from pathlib import Path

import click

from envbuild.cli.main import App, pass_app
from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json


def _open(app: App, url: str | None):
    return app.open_store(url) if url else app.open_store()


store_option = click.option("--store", "store_url", metavar="DIR|URL", default=None,
                            help="Store to use (default: the global --store, $ENVBUILD_STORE "
                                 "or ./cache).")


def register(group: click.Group) -> None:
    group.add_command(job)
    group.add_command(gc_cmd)


@click.group("job")
def job() -> None:
    """Training-job manifests: pin them to digests, check a store holds what they need."""


@job.command("resolve")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("-o", "--output", metavar="OUT", default=None,
              help="Where to write the resolved manifest (default: FILE.resolved.yaml next "
                   "to FILE; a *.resolved.* FILE is rewritten in place; '-': stdout).")
@store_option
@pass_app
def job_resolve(app: App, file: Path, output: str | None, store_url: str | None) -> None:
    """Pin every group's lock to a digest and record the layers it closes over."""
    from envbuild.jobs import default_output, load_job_manifest, resolve_job_manifest, write_job_manifest

    resolved = resolve_job_manifest(load_job_manifest(file), _open(app, store_url))
    dest = output if output is not None else default_output(file)
    write_job_manifest(resolved, dest)
    if dest != "-":
        click.echo(f"{dest}: {len(resolved.groups)} group(s) pinned", err=True)


@job.command("verify")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@store_option
@click.option("--jobs", "-j", type=click.IntRange(1), default=4, show_default=True,
              help="Blobs checked at once.")
@json_option("Print the report as JSON.")
@pass_app
def job_verify(app: App, file: Path, store_url: str | None, jobs: int, as_json: bool) -> int:
    """Check every lock, config, layer and TOC FILE needs: present, digests and TOCs
    intact. Lists every problem; exit 1 if there is any."""
    from envbuild.jobs import load_job_manifest, verify_job_manifest

    report = verify_job_manifest(load_job_manifest(file), _open(app, store_url), jobs=jobs)
    if as_json:
        echo_json(report.to_json())
    else:
        for p in report.problems:
            click.echo(p.render())
        click.echo(report.summary(), err=True)
    return 0 if report.ok else 1


@job.command("run")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--fleet", "address", metavar="ADDRESS", required=True,
              help="Ray cluster of the fleet (auto, HOST:PORT, ray://HOST:PORT).")
@click.option("--ttl", type=float, default=None, help="Lease of each sandbox (seconds).")
@json_option("Print the sandbox ids as JSON.")
@pass_app
def job_run(app: App, file: Path, address: str, ttl: float | None, as_json: bool) -> None:
    """Create every group of a resolved manifest across a fleet; print the sandbox ids."""
    from envbuild.cli.cmd_fleet import job_run as run

    run(app, file, address, as_json, ttl)


@click.command("gc")
@store_option
@click.option("--grace", default="24h", show_default=True, metavar="DURATION",
              help="Never delete a blob, record or partial write younger than this "
                   "(s, m, h, d, w).")
@click.option("--job", "job_files", multiple=True, metavar="FILE",
              type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="Keep everything this job manifest pins (repeatable).")
@click.option("--drop-cache", is_flag=True,
              help="Also delete key records (build cache) older than the grace period "
                   "whose layer no ref, lock or job uses.")
@click.option("--dry-run", "-n", is_flag=True, help="Report what would go; delete nothing.")
@json_option("Print the report as JSON.")
@pass_app
def gc_cmd(app: App, store_url: str | None, grace: str, job_files: tuple[Path, ...],
           drop_cache: bool, dry_run: bool, as_json: bool) -> None:
    """Delete blobs no ref, lock, key record or job manifest reaches, once older than
    --grace (see envbuild.store.gc for what is safe while builds run)."""
    from envbuild.jobs import load_job_manifest
    from envbuild.store.gc import gc, parse_duration

    roots = [d for f in job_files for d in load_job_manifest(f).blobs()]
    report = gc(_open(app, store_url), grace=parse_duration(grace), roots=roots,
                drop_cache=drop_cache, dry_run=dry_run)
    if as_json:
        echo_json(report.to_json())
        return
    verb = "would delete" if dry_run else "deleted"
    for item in report.deleted:
        click.echo(f"{verb} {item.kind} {item.name} {item.size} bytes")
    for d in report.dangling:
        click.echo(f"warning: dangling {d}", err=True)
    click.echo(report.summary(), err=True)
