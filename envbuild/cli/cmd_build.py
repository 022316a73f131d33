"""``envbuild build`` and ``envbuild lock``: build missing layers, lock envs, print a summary."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from envbuild.build.executor import BuildEvent


from envbuild.cli.main import App, pass_app
from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json
from envbuild.cli.richtext import literal
from envbuild.sizes import human_size


class PlainProgress:
    """One line per event, for CI logs and pipes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def __call__(self, e: BuildEvent) -> None:
        if e.phase == "step":
            what = f"step {e.step}/{e.steps} {e.detail}"
        elif e.phase == "done":
            what = f"done in {e.seconds:.1f}s"
        else:
            what = e.phase + (f": {e.detail}" if e.detail else "")
        where = f" on {e.node}" if e.node else ""  # --executor ray: the node it runs on
        with self._lock:
            click.echo(f"[{time.monotonic() - self._start:7.1f}s] {e.name}{where}: {what}",
                       err=True)


class RichProgress:
    """A live table, one row per layer, on a terminal."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self._rows: dict[str, str] = {}
        self._nodes: dict[str, str] = {}  # --executor ray: layer -> node
        self._lock = threading.Lock()
        self._live = Live(self._table(), console=Console(stderr=True), refresh_per_second=8)

    def _table(self):
        from rich.table import Table

        t = Table(show_header=True, header_style="bold", box=None)
        t.add_column("layer")
        if self._nodes:
            t.add_column("node")
        t.add_column("status")
        for name, status in self._rows.items():  # status: markup made by __call__
            if self._nodes:
                t.add_row(literal(name), literal(self._nodes.get(name, "")), status)
            else:
                t.add_row(literal(name), status)
        return t

    def __enter__(self):
        self._live.__enter__()
        return self

    def __exit__(self, *exc):
        self._live.__exit__(*exc)

    def __call__(self, e: BuildEvent) -> None:
        styles = {"failed": "[red]failed[/red]", "cached": "[dim]cached[/dim]",
                  "skipped": "[yellow]skipped[/yellow]"}
        if e.phase == "step":
            status = f"[cyan]step {e.step}/{e.steps}[/cyan] {literal(e.detail)}"
        elif e.phase == "done":
            status = f"[green]built[/green] in {e.seconds:.1f}s"
        else:
            status = styles.get(e.phase, literal(e.phase)) + (
                f" {literal(e.detail)}" if e.detail and e.phase != "step" else "")
        with self._lock:
            self._rows[e.name] = status
            if e.node:
                self._nodes[e.name] = e.node
            self._live.update(self._table())


def _summary(report) -> list[str]:
    lines = [f"{'layer':<28} {'key':<14} {'digest':<14} {'size':>10}  {'result':<8} {'seconds':>7}"]
    for o in report.layers:
        rec = o.record
        size = human_size(rec.size) if rec else "-"
        lines.append(f"{o.name:<28} {o.key[7:19]:<14} {(rec.layer[7:19] if rec else '-'):<14} "
                     f"{size:>10}  {o.status:<8} {o.seconds:>7.1f}")
    for lk in report.locks:
        lines.append(f"env {lk.env}: " + (f"locked {lk.digest} as {lk.ref}" if lk.digest
                                          else lk.error or "not locked"))
    for t in report.tasks:
        lines.append(f"task {t.task}: " + (f"locked {t.digest} as {t.ref}" if t.digest
                                           else t.error or "not locked"))
    return lines


class StepOutput:
    """``build -v``: each run step's output on stderr as it arrives, whole lines prefixed
    with the layer's name (layers build in parallel, so their lines interleave)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partial: dict[str, bytes] = {}

    def __call__(self, name: str, data: bytes) -> None:
        with self._lock:
            *lines, rest = (self._partial.pop(name, b"") + data).split(b"\n")
            if rest:
                self._partial[name] = rest
            for line in lines:
                click.echo(f"{name} | {line.decode('utf-8', 'replace')}", err=True)

    def flush(self) -> None:
        with self._lock:
            for name, rest in sorted(self._partial.items()):
                click.echo(f"{name} | {rest.decode('utf-8', 'replace')}", err=True)
            self._partial.clear()


def register(group: click.Group) -> None:
    group.add_command(build)
    group.add_command(lock)


@click.command()
@click.argument("names", nargs=-1)
@click.option("--jobs", "-j", type=click.IntRange(1), default=None,
              help="Layers built at once (default: number of cores).")
@click.option("--no-cache", is_flag=True, help="Rebuild even layers the store already has.")
@json_option("Print the report as JSON.")
@click.option("-v", "--verbose", is_flag=True,
              help="Stream each run step's output to stderr (it always goes to the log).")
# Ray build issue (15): a Ray task per missing layer on nodes offering envbuild_builder
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local",
              help="Build here (default) or as Ray tasks on a cluster.")
@click.option("--ray-address", metavar="ADDR", default=None,
              help="Ray cluster to join (default: $RAY_ADDRESS, else a running local one).")
@click.option("--jobs-per-node", type=click.IntRange(1), default=1,
              help="Builds per unit of a node's envbuild_builder resource (default 1).")
@click.option("--ray-env", "ray_env", metavar="NAME", multiple=True,
              help="Pass the driver's environment variable NAME to the build tasks "
                   "(repeatable; e.g. AWS_ACCESS_KEY_ID when nodes have no credentials).")
@pass_app
def build(app: App, names: tuple[str, ...], jobs: int | None, no_cache: bool,
          as_json: bool, verbose: bool, executor: str, ray_address: str | None,
          jobs_per_node: int, ray_env: tuple[str, ...]) -> int:
    """Build the layers of NAMES (default: everything) and lock their envs; a task's hidden
    layer is built with its env's layers and its task lock written after its env's lock."""
    from envbuild.build.engine import load

    if executor == "ray":
        return _build_ray(app, names, no_cache, as_json, ray_address, jobs_per_node, ray_env)
    project = load(app.settings.defs_dir)
    ctx = app.build_context()
    output = StepOutput() if verbose else None
    ctx.on_output = output
    # Streamed lines and a live rich display would garble each other: plain lines then.
    rich = RichProgress() if sys.stderr.isatty() and not as_json and not verbose else None
    with rich if rich is not None else contextlib.nullcontext():
        report = app.run_build(project, ctx, names or None, jobs=jobs or app.settings.jobs,
                               no_cache=no_cache, progress=rich or PlainProgress())
    if output is not None:
        output.flush()
    return _print_report(report, as_json)


@click.command()
@click.argument("names", metavar="ENV|TASK...", nargs=-1, required=True)
@json_option("Print {locks, tasks} as JSON; one TASK alone: {task, digest, env_lock, hidden}.")
@pass_app
def lock(app: App, names: tuple[str, ...], as_json: bool) -> None:
    """Write the lock of each ENV (every layer must be built), or of each TASK (its env's
    lock, then its task lock under task/NAME; its hidden layer must be built), and print its
    digest."""
    from envbuild.build.engine import load, publish_lock, publish_task_lock
    from envbuild.defs.model import Task

    project = load(app.settings.defs_dir)
    store = app.open_store()
    locks, tasks = [], []
    for name in names:
        if isinstance(project.defs.by_name.get(name), Task):
            task = publish_task_lock(project, store, name).to_json()
            tasks.append({k: task[k] for k in ("task", "digest", "env_lock", "hidden")})
            digest = task["digest"]
        else:
            digest = publish_lock(project, store, name)
            locks.append({"env": name, "digest": digest})
        if not as_json:  # as each is written: the ones before a failure are reported
            click.echo(f"{name} {digest}")
    if as_json:
        echo_json(tasks[0] if len(names) == 1 and tasks else {"locks": locks, "tasks": tasks})


def _print_report(report, as_json: bool) -> int:
    if as_json:
        echo_json(report_json(report))
    else:
        for line in _summary(report):
            click.echo(line)
    for o in report.failed:
        from envbuild.cli.main import report_error

        click.echo(f"--- {o.name} failed" + (f" on node {o.node}" if o.node else "") + ":",
                   err=True)
        report_error(o.error)
    return 0 if report.ok else 1


def _build_ray(app: App, names: tuple[str, ...], no_cache: bool, as_json: bool,
               address: str | None, jobs_per_node: int, ray_env: tuple[str, ...]) -> int:
    """``build --executor ray``: the driver (envbuild.build.ray_executor)."""
    import signal

    from envbuild.build.engine import load
    from envbuild.build.ray_executor import RayBuildRequest, build_ray, forward_names

    project = load(app.settings.defs_dir.absolute())  # tasks read sources where it points
    request = RayBuildRequest(address=address, jobs_per_node=jobs_per_node,
                              forward_env=forward_names(ray_env))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # cancel like Ctrl-C
    kw = {}
    if app.settings.cache_from:
        kw["cache_from"] = app.open_store(app.settings.cache_from)
    if app.settings.cache_to:
        kw["cache_to"] = app.open_store(app.settings.cache_to)
    rich = RichProgress() if sys.stderr.isatty() and not as_json else None
    progress = rich or PlainProgress()

    def run():
        return build_ray(project, app.settings, names or None, request=request,
                         no_cache=no_cache, progress=progress, **kw)

    # Ray prints what its processes say (e.g. "(raylet) Raylet is terminated" when a node
    # dies) on the driver's stdout: during the build that goes to stderr, so stdout holds only
    # the report (--json stays parseable).
    from envbuild.build.ray_executor import disconnect

    with contextlib.redirect_stdout(sys.stderr):
        try:
            with rich if rich is not None else contextlib.nullcontext():
                report = run()
        finally:
            disconnect()
    return _print_report(report, as_json)


def report_json(report) -> dict:
    return {
        "layers": [{"name": o.name, "kind": o.kind, "key": o.key, "status": o.status,
                    "digest": o.record.layer if o.record else None,
                    "size": o.record.size if o.record else None,
                    "seconds": round(o.seconds, 3),
                    "node": o.node or None,
                    "error": o.error.message if o.error else None,
                    "blocked_by": o.blocked_by} for o in report.layers],
        "locks": [{"env": lk.env, "digest": lk.digest, "ref": lk.ref, "error": lk.error}
                  for lk in report.locks],
        "tasks": [t.to_json() for t in report.tasks],
    }
