import threading
import time

from envbuild.build.scheduler import run_dag


def test_dependencies_run_first_and_independent_jobs_overlap():
    order, active, peak = [], [0], [0]
    lock = threading.Lock()

    def work(name):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
            order.append(name)
        return name.upper()

    deps = {"ws1": ["base"], "ws2": ["base"], "tk": ["base"], "base": []}
    results = run_dag(["ws1", "ws2", "tk", "base"], deps, work, jobs=2)
    assert order[0] == "base"
    assert {r.outcome for r in results.values()} == {"done"}
    assert results["ws1"].value == "WS1"
    assert peak[0] == 2


def test_failure_skips_dependents_and_lets_unrelated_finish():
    def work(name):
        if name == "base-a":
            raise RuntimeError("step 1 failed")
        return name

    deps = {"ws-a": ["base-a"], "env-like": ["ws-a"], "ws-b": ["base-b"]}
    results = run_dag(["base-a", "ws-a", "env-like", "base-b", "ws-b"], deps, work, jobs=2)
    assert results["base-a"].outcome == "failed"
    assert str(results["base-a"].error) == "step 1 failed"
    assert results["ws-a"].outcome == "skipped" and results["ws-a"].blocked_by == "base-a"
    assert results["env-like"].outcome == "skipped"
    assert results["ws-b"].outcome == "done" and results["base-b"].outcome == "done"


def test_same_key_is_built_once():
    calls = []

    def work(name):
        calls.append(name)
        time.sleep(0.02)
        return f"built-by-{name}"

    keys = {"a": "k1", "b": "k1", "c": "k2"}
    results = run_dag(["a", "b", "c"], {}, work, key_of=keys.__getitem__, jobs=2)
    assert sorted(calls) == ["a", "c"]
    assert results["b"].value == "built-by-a"


def test_dependencies_outside_the_job_set_are_already_satisfied():
    results = run_dag(["ws"], {"ws": ["cached-base"]}, lambda n: 1, jobs=1)
    assert results["ws"].outcome == "done"


def test_cancel_stops_starting_new_jobs():
    cancelled = threading.Event()

    def work(name):
        cancelled.set()
        return name

    results = run_dag(["a", "b"], {"b": ["a"]}, work, jobs=1, cancelled=cancelled)
    assert results["a"].outcome == "done"
    assert results["b"].outcome == "skipped" and results["b"].blocked_by == "cancelled"
