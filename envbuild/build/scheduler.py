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
    todo = list(dict.fromkeys(names))
    wanted = set(todo)
    waiting_on = {n: {d for d in deps.get(n, ()) if d in wanted} for n in todo}
    dependents: dict[str, list[str]] = {n: [] for n in todo}
    for n, ds in waiting_on.items():
        for d in ds:
            dependents[d].append(n)
    key_of = key_of or (lambda n: n)
    cancelled = cancelled or threading.Event()
    results: dict[str, JobResult] = {}
    key_futures: dict[str, Future] = {}
    running: dict[Future, str] = {}
    ready = [n for n in todo if not waiting_on[n]]

    def skip(name: str, because: str) -> None:
        if name in results:
            return
        results[name] = JobResult(name, "skipped", blocked_by=because)
        if on_skip:
            on_skip(name, because)
        for child in dependents[name]:
            skip(child, because)

    def start(pool: ThreadPoolExecutor, name: str) -> None:
        key = key_of(name)
        shared = key_futures.get(key)
        if shared is None:
            shared = key_futures[key] = pool.submit(work, name)
        else:
            # Same key already building or built: wait for that build, do not start another.
            shared = pool.submit(lambda f=shared: f.result())
        running[shared] = name

    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="build") as pool:
        try:
            while ready or running:
                while ready and not cancelled.is_set():
                    start(pool, ready.pop(0))
                if not running:
                    break
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    name = running.pop(fut)
                    try:
                        value = fut.result()
                    except BaseException as e:  # noqa: BLE001 - recorded per job, reported by caller
                        results[name] = JobResult(name, "failed", error=e)
                        for child in dependents[name]:
                            skip(child, name)
                        continue
                    results[name] = JobResult(name, "done", value=value)
                    for child in dependents[name]:
                        waiting_on[child].discard(name)
                        if not waiting_on[child] and child not in results:
                            ready.append(child)
        except BaseException:
            cancelled.set()
            # Queued jobs must not start while the pool's exit waits for the running ones
            # (which see ``cancelled`` and clean up).
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    for n in todo:
        if n not in results:
            results[n] = JobResult(n, "skipped", blocked_by="cancelled")
    return results
