"""``envbuild check``: run every workspace's ``check:`` commands in each env that uses it.

This is how a base that broke its ABI contract is caught: workspaces are reused across base
updates (the O(m) rule), so after re-locking, each env runs its workspace's checks in a real
sandbox over the new lock (no network, default limits).

Each ``check:`` entry is a command with its own deadline (``CheckCommand``: a string gets
``DEFAULT_CHECK_TIMEOUT``, ``{run, timeout}`` its own). A command that exits non-zero or runs
past its deadline fails; its result keeps the tail of its output (``CheckResult.tail``) and a
passing one the test runner's summary line (``CheckResult.summary``: pytest's ``1322 passed
in 9.1s``, unittest's ``Ran 40 tests`` + ``OK``, or a plain ``N passed, N failed``). With
``jobs > 1`` several envs run at once, each in its own sandbox; results come back grouped by
env, in the order of ``envs``.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from envbuild.build.pin import Snapshot
from envbuild.defs.model import Env, Workspace
from envbuild.errors import BuildError
from envbuild.store import Store

#: Lines of output a failed check shows.
TAIL_LINES = 20

# The closing line of the usual runners: pytest's "===== 3 passed, 1 skipped in 0.12s =====",
# "1322 passed in 9.1s", the plain "N passed, N failed", unittest's "Ran 40 tests in 0.1s".
_SUMMARY = re.compile(
    r"^\W*(?:\w+:\s*)?(\d+ (?:passed|failed|errors?|error)\b.*?)\W*$|^(Ran \d+ tests? in .*)$")


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One check command's outcome in one env (``timeout``: its deadline in seconds)."""

    env: str
    workspace: str
    command: str
    exit_code: int
    output: str
    seconds: float
    timed_out: bool = False
    timeout: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def tail(self) -> list[str]:
        """The last ``TAIL_LINES`` lines of the output (what a failure shows)."""
        return self.output.splitlines()[-TAIL_LINES:]

    @property
    def summary(self) -> str | None:
        """The test runner's summary line (the last one in the output), or None."""
        return runner_summary(self.output)


def runner_summary(output: str) -> str | None:
    """The last line of ``output`` that reads like a test runner's result, stripped of the
    ``====`` decoration: ``1322 passed, 3 skipped in 9.10s``; None if there is none."""
    for line in reversed(output.splitlines()[-200:]):
        m = _SUMMARY.match(line.strip())
        if m:
            return (m.group(1) or m.group(2)).strip()
    return None


def env_workspace(project: Snapshot, name: str) -> Workspace | None:
    """The workspace of env ``name`` if it has checks; ``BuildError`` for an unknown env."""
    env = project.graph[name] if name in project.graph.defs.by_name else None
    if not isinstance(env, Env):
        raise BuildError(f"no env named {name!r}", hint="envbuild graph lists the envs")
    ws = project.graph[env.workspace] if env.workspace else None
    return ws if isinstance(ws, Workspace) and ws.check else None


def run_checks(project: Snapshot, store: Store, node_dir: Path, envs: Iterable[str] | None = None,
               *, runtime: str = "runc", jobs: int = 1,
               on_env: Callable[[str, list[CheckResult]], None] | None = None
               ) -> list[CheckResult]:
    """Run the checks of ``envs`` (default: every env), ``jobs`` envs at a time; return every
    result grouped by env in the order of ``envs``. ``on_env(env, results)`` is called once
    per env as soon as its checks are done (from one thread at a time). Unknown env names are
    refused before any sandbox starts."""
    names = list(envs) if envs else sorted(e.name for e in project.graph.defs.envs)
    todo = [(n, ws) for n in names if (ws := env_workspace(project, n)) is not None]
    report = threading.Lock()

    def one(item: tuple[str, Workspace]) -> list[CheckResult]:
        name, ws = item
        results = _check_env(name, ws, store, node_dir, runtime)
        if on_env is not None:
            with report:
                on_env(name, results)
        return results

    if jobs <= 1 or len(todo) <= 1:
        grouped = [one(item) for item in todo]
    else:
        with ThreadPoolExecutor(max_workers=min(jobs, len(todo)),
                                thread_name_prefix="envbuild-check") as pool:
            grouped = list(pool.map(one, todo))
    return [r for group in grouped for r in group]


def _check_env(name: str, ws: Workspace, store: Store, node_dir: Path,
               runtime: str) -> list[CheckResult]:
    from runtime_shim import Sandbox

    results = []
    with Sandbox.create(f"env/{name}", store=store, node_dir=node_dir, runtime=runtime) as sb:
        for c in ws.check:
            r = sb.exec(c.run, timeout=c.timeout)
            output = (r.stdout + r.stderr).decode(errors="replace")
            results.append(CheckResult(name, ws.name, c.run, r.exit_code, output, r.duration,
                                       timed_out=r.timed_out, timeout=c.timeout))
    return results
