"""Commands over the graph: ``graph``, ``plan``, ``explain``. Parse, one library call, render."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json
from envbuild.cli.richtext import literal
from envbuild.plan.changes import Changes, Explanation
from envbuild.plan.graph import EnvGraph
from envbuild.plan.planner import BuildPlan


def _app():
    from envbuild.cli.main import App

    return click.get_current_context().find_object(App)


def _short(key: str) -> str:
    return key[: len("sha256:") + 12]


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A rich table on a terminal, plain aligned columns otherwise (pipes, files, tests)."""
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        t = Table(title=literal(title), title_justify="left")
        for c in columns:
            t.add_column(literal(c))
        for r in rows:
            t.add_row(*map(literal, r))
        Console().print(t)
        return
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    click.echo(title)
    for r in [columns, *rows]:
        click.echo("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


# ---------------------------------------------------------------------- graph


def render_graph(graph: EnvGraph, fmt: str) -> None:
    gens = graph.generations()
    if fmt == "json":
        echo_json({"nodes": [{"name": n, "kind": graph[n].kind,
                              "depends_on": list(graph.dependencies(n))}
                             for gen in gens for n in gen],
                   "generations": gens})
    elif fmt == "dot":
        click.echo("digraph envbuild {\n  rankdir=BT;")
        for gen in gens:
            for n in gen:
                click.echo(f'  "{n}" [label="{n}\\n{graph[n].kind}"];')
                for dep in graph.dependencies(n):
                    click.echo(f'  "{n}" -> "{dep}";')
        click.echo("}")
    else:
        for i, gen in enumerate(gens):
            _table(f"generation {i}", ["kind", "name", "depends on"],
                   [[graph[n].kind, n, ", ".join(graph.dependencies(n))] for n in gen])


# ---------------------------------------------------------------------- plan


def render_plan(plan: BuildPlan, changes: Changes | None, as_json: bool) -> None:
    if as_json:
        out = plan.to_json()
        if changes is not None:
            out.update(changes.to_json())
        echo_json(out)
        return
    rebuild = set(changes.rebuild) if changes else set()
    for i, steps in enumerate(plan.generations):
        rows = [[s.status + (" (changed)" if s.name in rebuild else ""), s.kind, s.name,
                 _short(s.key), ", ".join(s.depends_on)] for s in steps]
        _table(f"generation {i}", ["status", "kind", "name", "key", "depends on"], rows)
    if plan.envs:
        _table("envs", ["env", "layers (bottom to top)"],
               [[e.name, " < ".join(e.layers)] for e in plan.envs])
    if plan.tasks:
        _table("tasks (hidden layer: in the task lock only)",
               ["status", "task", "env", "hidden layer", "key"],
               [[t.status, t.name, t.env, t.hidden, _short(t.key) if t.key else "-"]
                for t in plan.tasks])
    missing = len(plan.missing)
    n = len(plan.tasks)
    tasks = f", {n} task{'' if n == 1 else 's'}" if n else ""
    click.echo(f"{len(plan.layers)} layers ({missing} missing), {len(plan.envs)} envs{tasks}")
    if changes is not None:
        click.echo(f"rebuild ({len(changes.rebuild)}): {', '.join(changes.rebuild) or '-'}")
        click.echo(f"relock ({len(changes.relock)}): {', '.join(changes.relock) or '-'}")


def render_explanation(e: Explanation, against: str | None) -> None:
    from envbuild.plan.changes import flatten

    what = "lock inputs digest" if e.kind == "Env" else "key"
    click.echo(f"{e.kind} {e.name}")
    click.echo(f"{what}: {e.digest}")
    click.echo("inputs:")
    for path, value in flatten(e.inputs):
        click.echo(f"  {path}: {value!r}")
    if e.changes is None:
        return
    if e.old_digest is None:
        click.echo(f"at {against}: did not exist")
    elif e.old_digest == e.digest:
        click.echo(f"at {against}: same {what}, no input changed")
    else:
        click.echo(f"at {against}: {what} {e.old_digest}")
        click.echo(f"changed since {against}:")
    for c in e.changes if e.old_digest else ():
        click.echo(f"  {c.render()}")


# ---------------------------------------------------------------------- commands


def _store_lookup(app):
    """Key-record lookup in the store, or None (all missing) when there is no store yet:
    a dry run must not create ``./cache`` as a side effect."""
    from envbuild.store.helpers import get_key_record

    url = app.settings.store_url
    if "://" not in url and not Path(url).is_dir():
        return None
    store = app.open_store()
    return lambda key: get_key_record(store, key)


def register(group: click.Group) -> None:
    group.add_command(graph_cmd)
    group.add_command(plan_cmd)
    group.add_command(explain_cmd)


@click.command("graph")
@click.option("--format", "fmt", type=click.Choice(["text", "dot", "json"]), default="text",
              show_default=True, help="Aligned text, Graphviz dot, or JSON.")
@json_option("The same as --format json.")
def graph_cmd(fmt: str, as_json: bool) -> None:
    """Print the definition DAG, dependencies first."""
    from envbuild.plan.graph import check_tree

    if as_json and fmt == "dot":
        raise click.UsageError("--json prints JSON, --format dot prints dot: give one")
    render_graph(check_tree(_app().settings.defs_dir), "json" if as_json else fmt)


@click.command("plan")
@click.argument("names", nargs=-1)
@json_option("Print one JSON object.")
@click.option("--changed-since", "rev", metavar="REV",
              help="Also report layers to rebuild and envs to re-lock since git REV.")
def plan_cmd(names: tuple[str, ...], as_json: bool, rev: str | None) -> None:
    """Show what would be built (layers and keys, cached or missing); build nothing."""
    from envbuild.build.gitrev import plan_changes
    from envbuild.defs.parsecache import ParseCache

    app = _app()
    # Ray build issue (15): files parsed before (either tree) are not parsed again
    plan, changes = plan_changes(app.settings.defs_dir, list(names) or None, rev,
                                 lookup=_store_lookup(app),
                                 parse_cache=ParseCache(app.settings.node_dir / "parse"))
    render_plan(plan, changes, as_json)


@click.command("explain")
@click.argument("name")
@click.option("--against", "rev", metavar="REV", help="Show which inputs changed since REV.")
@json_option()
def explain_cmd(name: str, rev: str | None, as_json: bool) -> None:
    """List every input of NAME's key (or an env's lock inputs) and what changed."""
    from envbuild.build.gitrev import explain_at

    e = explain_at(_app().settings.defs_dir, name, rev)
    echo_json(e.to_json()) if as_json else render_explanation(e, rev)
