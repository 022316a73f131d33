"""``envbuild grade``: a task's grade of an agent's work, in a fresh sandbox, as a verdict
(``runtime_shim.grading``)."""

from __future__ import annotations

import sys

import click

from envbuild.cli.main import App, pass_app
from envbuild.cli.options import json_option
from envbuild.cli.output import echo_json

#: the exit status of a grade that ran and did not pass (1 is an error, 2 click's usage error)
EXIT_NOT_PASSED = 3


def register(group: click.Group) -> None:
    group.add_command(grade)


@click.command()
@click.argument("task")
@click.option("--from", "source", required=True, metavar="SANDBOX|REF",
              help="The agent's work: a sandbox on this node (its id), or a snapshot's ref or "
                   "lock digest (envbuild pack-diff --publish snap/NAME).")
@click.option("--no-record", is_flag=True, help="Do not record the verdict in the store.")
@json_option("Print the verdict as one JSON object (docs/cli-json.md).")
@pass_app
def grade(app: App, task: str, source: str, no_record: bool, as_json: bool) -> None:
    """Grade an agent's work on TASK (task/NAME or a task lock digest).

    The agent's changes are filtered (only what the task lets it change is kept; each drop is
    listed), laid on a fresh sandbox of the task's env lock with its hidden tests, and the
    task's grade command runs there. Exit status: 0 passed, 3 graded and not passed, 1 error.
    """
    from runtime_shim import grade as grade_work

    verdict = grade_work(task, source, store=app.open_store(), node_dir=app.settings.node_dir,
                         record=not no_record)
    if as_json:
        echo_json(verdict.to_json())
    else:
        _show(verdict)
    if not verdict.passed:
        sys.exit(EXIT_NOT_PASSED)


def _show(verdict) -> None:
    seconds = verdict.seconds
    head = "PASSED" if verdict.passed else "FAILED"
    named = len(verdict.tests)
    ok = sum(1 for o in verdict.tests.values() if o == "passed")
    click.echo(f"{head} {verdict.task[:19]} ({ok}/{named} named tests passed, exit "
               f"{'timeout' if verdict.timed_out else verdict.exit_code}) in "
               f"{seconds['total']:.2f}s")
    if verdict.reason:
        click.echo(f"  why: {verdict.reason}")
    for test_id, outcome in verdict.tests.items():
        if outcome != "passed":
            click.echo(f"  {outcome}: {test_id}")
    more = f" (+{verdict.dropped_more} more)" if verdict.dropped_more else ""
    click.echo(f"  change set {verdict.change_set}, {len(verdict.dropped)} change(s) dropped"
               f"{more}")
    for d in verdict.dropped:
        click.echo(f"    dropped {d['path']}: {d['reason']}")
    if verdict.record:
        click.echo(f"  verdict recorded as {verdict.record}")
