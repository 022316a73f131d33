"""Run a DAG of build jobs on a thread pool: parallel where independent, never twice per key.

Generic over what a job does: ``run_dag`` gets job names, their dependencies, the key each
job produces and a ``work(name)`` callable. Rules:

- a job starts when all its dependencies succeeded, at most ``jobs`` at once;
- two jobs with the same key are one build: the second waits for the first and shares its
  outcome (identically defined layers under two names);
- a failed job fails its dependents (``skipped``) but lets unrelated jobs finish;
- ``KeyboardInterrupt`` / ``cancel()`` stops starting new jobs; running ones are asked to stop
  through the ``cancelled`` event they can poll, and the caller's ``work`` cleans up.

Across processes, exclusivity per key is the executor's job (a lock file per key), because
only it knows where the store and node cache live.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Literal

Outcome = Literal["done", "failed", "skipped"]


@dataclasses.dataclass
class JobResult:
    name: str
    outcome: Outcome
    value: Any = None
    error: BaseException | None = None
    blocked_by: str | None = None  # for ``skipped``: the failed dependency


def run_dag(
    names: Iterable[str],
    deps: Mapping[str, Iterable[str]],
    work: Callable[[str], Any],
    *,
    key_of: Callable[[str], str] | None = None,
    jobs: int = 2,
    on_skip: Callable[[str, str], None] | None = None,
    cancelled: threading.Event | None = None,
) -> dict[str, JobResult]:
    """Run ``work(name)`` for every name, dependencies first. Returns every job's result.

    ``deps[name]`` may mention names outside ``names`` (already built): those are ignored.
    """
    dag = _Dag(list(dict.fromkeys(names)), deps, work, key_of or (lambda n: n), on_skip)
    cancelled = cancelled or threading.Event()
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="build") as pool:
        try:
            while dag.ready or dag.running:
                while dag.ready and not cancelled.is_set():
                    dag.start(pool, dag.ready.pop(0))
                if not dag.running:
                    break
                done, _ = wait(list(dag.running), return_when=FIRST_COMPLETED)
                for fut in done:
                    dag.finished(fut)
        except BaseException:
            cancelled.set()
            # Queued jobs must not start while the pool's exit waits for the running ones
            # (which see ``cancelled`` and clean up).
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    for n in dag.todo:
        if n not in dag.results:
            dag.results[n] = JobResult(n, "skipped", blocked_by="cancelled")
    return dag.results


class _Dag:
    """The state of one ``run_dag``: what each job still waits on, what is ready, running
    (future -> name; one future per key) and done."""

    def __init__(self, todo: list[str], deps: Mapping[str, Iterable[str]],
                 work: Callable[[str], Any], key_of: Callable[[str], str],
                 on_skip: Callable[[str, str], None] | None) -> None:
        self.todo, self.work, self.key_of, self.on_skip = todo, work, key_of, on_skip
        wanted = set(todo)
        self.waiting_on = {n: {d for d in deps.get(n, ()) if d in wanted} for n in todo}
        self.dependents: dict[str, list[str]] = {n: [] for n in todo}
        for n, ds in self.waiting_on.items():
            for d in ds:
                self.dependents[d].append(n)
        self.results: dict[str, JobResult] = {}
        self.key_futures: dict[str, Future] = {}
        self.running: dict[Future, str] = {}
        self.ready = [n for n in todo if not self.waiting_on[n]]

    def skip(self, name: str, because: str) -> None:
        if name in self.results:
            return
        self.results[name] = JobResult(name, "skipped", blocked_by=because)
        if self.on_skip:
            self.on_skip(name, because)
        for child in self.dependents[name]:
            self.skip(child, because)

    def start(self, pool: ThreadPoolExecutor, name: str) -> None:
        key = self.key_of(name)
        first = self.key_futures.get(key)
        if first is None:
            shared = self.key_futures[key] = pool.submit(self.work, name)
        else:
            # Same key already building or built: wait for that build, do not start another.
            shared = pool.submit(first.result)
        self.running[shared] = name

    def finished(self, fut: Future) -> None:
        """Record a finished job; its dependents become ready, or are skipped if it failed."""
        name = self.running.pop(fut)
        try:
            value = fut.result()
        except BaseException as e:  # noqa: BLE001 - recorded per job, reported by caller
            self.results[name] = JobResult(name, "failed", error=e)
            for child in self.dependents[name]:
                self.skip(child, name)
            return
        self.results[name] = JobResult(name, "done", value=value)
        for child in self.dependents[name]:
            self.waiting_on[child].discard(name)
            if not self.waiting_on[child] and child not in self.results:
                self.ready.append(child)
