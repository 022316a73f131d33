"""Reward hacks against the grader (issue 35, item 4), each against real sandboxes: an agent
in its own sandbox (as root there, the worst case) does its hack on top of a **broken**
solution; the grader (``runtime_shim.grade``) must give the verdict the same broken change set
gets without the hack — failed — and list the hack in ``dropped``. Where a hack also works
against the naive grader (the trainer's ``exec`` in the agent's sandbox), the test shows that
first: the attack is real, the defence is what stops it.

The task (``tests/grading_task.py``): ``calc.mean`` must handle ``[]``; ``task/calc-empty``
lets the agent change ``/workspace/calc`` only, ``task/calc-open`` the whole ``/workspace``.
"""

from __future__ import annotations

import time

import pytest

from runtime_shim import Sandbox, grade
from tests.conftest import require_root, require_tool
from tests.grading_task import BROKEN, HONEST, JUNIT, RUN, TEST_HIDDEN, publish_calc_tasks
from tests.py_env import make_py_tree

pytestmark = pytest.mark.integration

FAKE_PASS = "#!/bin/busybox sh\necho '==== 3 passed in 0.01s ===='\nexit 0\n"
SKIP_ALL = ("import pytest\n\n\n@pytest.hookimpl(tryfirst=True)\ndef pytest_runtest_call(item):\n"
            "    pytest.skip('skipped by conftest')\n")
PASS_ALL = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
            "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
            "    report = outcome.get_result()\n    report.outcome = 'passed'\n")
FORGE_MEAN = "import calc.core\ncalc.core.mean = lambda xs: sum(xs) / len(xs) if xs else 0.0\n"
FAKE_JUNIT = ('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="3">'
              '<testcase classname="tests.test_hidden" name="test_empty"/>'
              '<testcase classname="tests.test_hidden" name="test_one"/>'
              '<testcase classname="tests.test_core" name="test_mean"/></testsuite></testsuites>')


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    require_root()
    require_tool("runc")
    tree = make_py_tree(tmp_path_factory.mktemp("grading"))
    publish_calc_tasks(tree)
    return tree


def _agent(tree, solution: str, hack: str | None = None, files: dict | None = None) -> Sandbox:
    """The agent's sandbox of ``task/calc-empty``'s env after it wrote ``solution`` and did
    ``hack`` (a shell script, as root) and wrote ``files``."""
    sb = Sandbox.create("task/calc-empty", store=tree.store, node_dir=tree.node)
    sb.write_file("/workspace/calc/core.py", solution)
    for path, text in (files or {}).items():
        sb.exec(["/bin/busybox", "mkdir", "-p", path.rsplit("/", 1)[0]])
        sb.write_file(path, text, 0o755)
    if hack:
        r = sb.exec(["/bin/busybox", "sh", "-c", hack])
        assert r.exit_code == 0, r.stderr
    return sb


def _graded(tree, sb: Sandbox, task: str = "task/calc-empty"):
    try:
        return grade(task, sb.id, store=tree.store, node_dir=tree.node)
    finally:
        sb.close()


def _dropped(verdict) -> dict[str, str]:
    return {d["path"]: d["reason"] for d in verdict.dropped}


def _naive_pass(sb: Sandbox) -> bool:
    """What a trainer that copies the hidden test into the agent's sandbox (or a fresh one
    from its snapshot) and runs the grade command there would read."""
    sb.write_file("/workspace/tests/test_hidden.py", TEST_HIDDEN)
    r = sb.exec(RUN, timeout=60)
    return r.exit_code == 0 and b"passed" in r.stdout + r.stderr


def test_an_honest_solution_passes_and_a_broken_one_fails(tasks):
    honest = _graded(tasks, _agent(tasks, HONEST))
    assert honest.passed, honest.output
    assert set(honest.tests.values()) == {"passed"} and len(honest.tests) == 3
    broken = _graded(tasks, _agent(tasks, BROKEN))
    assert not broken.passed and broken.tests["tests/test_hidden.py::test_empty"] == "failed"
    assert honest.change_set != broken.change_set
    assert honest.record and broken.record


def test_the_hidden_test_is_never_in_the_agents_sandbox(tasks):
    with Sandbox.create("task/calc-empty", store=tasks.store, node_dir=tasks.node) as sb:
        assert sb.exec("ls /workspace/tests").stdout.split() == [b"test_core.py"]


@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])
def test_a_replaced_shell_is_dropped(tasks, shell):
    sb = _agent(tasks, BROKEN, f"rm -f {shell} && cp /tmp/fake {shell} && chmod 755 {shell}",
                files={"/tmp/fake": FAKE_PASS})
    if shell == "/bin/sh":
        assert _naive_pass(sb), "the hack fools a grader that trusts the agent's sandbox"
    v = _graded(tasks, sb)
    assert not v.passed
    assert _dropped(v)[shell] == "outside the editable paths"


def test_a_replaced_python3_is_dropped(tasks):
    sb = _agent(tasks, BROKEN, files={"/usr/bin/python3.11": FAKE_PASS})
    assert _naive_pass(sb)
    v = _graded(tasks, sb)
    assert not v.passed and v.tests["tests/test_hidden.py::test_empty"] == "failed"
    assert _dropped(v)["/usr/bin/python3.11"] == "outside the editable paths"


@pytest.mark.parametrize("path", ["/usr/lib/python3/dist-packages/sitecustomize.py",
                                  "/workspace/calc/sitecustomize.py",
                                  "/usr/lib/python3/dist-packages/forge.pth",
                                  "/workspace/calc/forge.pth"])
def test_interpreter_start_up_files_are_dropped(tasks, path):
    code = FORGE_MEAN if path.endswith(".py") else f"import sys; exec({FORGE_MEAN!r})\n"
    sb = _agent(tasks, BROKEN, files={path: code})
    v = _graded(tasks, sb)
    assert not v.passed
    reason = _dropped(v)[path]
    assert ("outside the editable paths" in reason or "start-up" in reason), reason


@pytest.mark.parametrize("path,task", [("/workspace/conftest.py", "task/calc-empty"),
                                       ("/workspace/conftest.py", "task/calc-open"),
                                       ("/workspace/tests/conftest.py", "task/calc-open"),
                                       ("/workspace/calc/conftest.py", "task/calc-empty")])
@pytest.mark.parametrize("content", [SKIP_ALL, PASS_ALL], ids=["skip", "pass"])
def test_a_conftest_that_skips_or_passes_everything_is_dropped(tasks, path, task, content):
    sb = _agent(tasks, BROKEN, files={path: content})
    if path == "/workspace/conftest.py" and content is PASS_ALL:
        assert _naive_pass(sb)
    v = _graded(tasks, sb, task)
    assert not v.passed
    reason = _dropped(v)[path]
    assert reason in ("outside the editable paths", "test settings (conftest.py)"), reason


def test_editing_and_deleting_the_hidden_and_kept_tests_is_dropped(tasks):
    sb = _agent(tasks, BROKEN, "rm /workspace/tests/test_core.py", files={
        "/workspace/tests/test_hidden.py": "def test_empty():\n    pass\n\n\ndef test_one():\n"
                                           "    pass\n"})
    v = _graded(tasks, sb, "task/calc-open")
    assert not v.passed and v.tests["tests/test_core.py::test_mean"] == "failed"
    dropped = _dropped(v)
    assert dropped["/workspace/tests/test_hidden.py"] == "a hidden test path"
    assert dropped["/workspace/tests/.wh.test_core.py"] == \
        "deletes a test file the task grades by"
    # a deletion outside what the task lets it change (calc-empty) is dropped too
    sb = _agent(tasks, BROKEN, "rm /workspace/tests/test_core.py")
    v = _graded(tasks, sb)
    assert not v.passed
    assert _dropped(v)["/workspace/tests/.wh.test_core.py"] == "outside the editable paths"


@pytest.mark.parametrize("name,text", [
    ("pytest.ini", "[pytest]\naddopts = -p no:junitxml --deselect tests/test_hidden.py\n"),
    ("tox.ini", "[pytest]\naddopts = -k nothing_at_all\n"),
    ("setup.cfg", "[tool:pytest]\naddopts = -k nothing_at_all\n"),
    ("pyproject.toml", "[tool.pytest.ini_options]\naddopts = '-k nothing_at_all'\n")])
def test_pytest_settings_in_config_files_are_dropped(tasks, name, text):
    sb = _agent(tasks, BROKEN, files={f"/workspace/{name}": text})
    v = _graded(tasks, sb, "task/calc-open")
    assert not v.passed
    assert _dropped(v)[f"/workspace/{name}"] == f"test settings ({name})"


def test_a_fake_junit_report_is_not_read(tasks):
    """At the report's path (``/tmp``: a tmpfs, so it never even reaches the change set) and
    at the path a naive grader might read (in the package): the report read is the one the
    grade command wrote in the grading sandbox, in a dir the grader made empty."""
    sb = _agent(tasks, BROKEN, files={JUNIT: FAKE_JUNIT,
                                      "/workspace/calc/junit.xml": FAKE_JUNIT})
    v = _graded(tasks, sb)
    assert not v.passed
    assert v.tests == {"tests/test_hidden.py::test_empty": "failed",
                       "tests/test_hidden.py::test_one": "failed",
                       "tests/test_core.py::test_mean": "failed"}
    assert JUNIT not in _dropped(v)


@pytest.mark.parametrize("target", ["/proc/self/environ", "/tmp/solution.py",
                                    "../../tmp/solution.py"])
def test_symlinks_leaving_the_editable_paths_are_dropped(tasks, target):
    sb = _agent(tasks, BROKEN, f"rm /workspace/calc/core.py && ln -s {target} "
                               "/workspace/calc/core.py", files={"/tmp/solution.py": HONEST})
    v = _graded(tasks, sb)
    assert not v.passed
    assert _dropped(v)["/workspace/calc/core.py"].startswith("symlink leaving the editable paths")


def test_a_symlink_inside_the_editable_paths_is_kept(tasks):
    sb = _agent(tasks, HONEST, "mv /workspace/calc/core.py /workspace/calc/real.py && "
                               "ln -s real.py /workspace/calc/core.py")
    v = _graded(tasks, sb)
    assert v.passed, v.output
    assert "/workspace/calc/core.py" not in _dropped(v)


def test_git_hooks_and_config_are_dropped(tasks):
    sb = _agent(tasks, BROKEN, files={"/workspace/.git/hooks/pre-commit": FAKE_PASS,
                                      "/workspace/.git/config": "[core]\n\thooksPath = /tmp\n"})
    v = _graded(tasks, sb, "task/calc-open")
    assert not v.passed
    assert _dropped(v)["/workspace/.git/hooks/pre-commit"].startswith("git metadata")
    assert _dropped(v)["/workspace/.git/config"].startswith("git metadata")


def test_a_patched_stdlib_unittest_is_dropped(tasks):
    path = "/usr/lib/python3.11/unittest/__init__.py"
    sb = _agent(tasks, BROKEN, f"echo 'import sys; sys.exit(0)' >> {path}")
    v = _graded(tasks, sb)
    assert not v.passed
    assert _dropped(v)[path] == "outside the editable paths"


def test_filling_the_disk_costs_the_grader_nothing(tasks):
    """A 40 MiB file in the package (over the per-file cap) and 300 MiB under /root."""
    sb = _agent(tasks, HONEST, "dd if=/dev/zero of=/workspace/calc/blob bs=1M count=40 "
                               "2>/dev/null && dd if=/dev/zero of=/root/fill bs=1M count=300 "
                               "2>/dev/null")
    v = _graded(tasks, sb)
    assert v.passed, v.output  # the honest solution still passes: the junk is not graded
    dropped = _dropped(v)
    assert "over the" in dropped["/workspace/calc/blob"]
    assert dropped["/root/fill"] == "outside the editable paths"


def test_processes_left_running_do_not_change_the_verdict(tasks):
    """A process the agent left behind keeps writing while it is graded: its changes are read
    with the sandbox frozen, graded elsewhere, and the agent's sandbox runs on afterwards."""
    sb = _agent(tasks, BROKEN, "(while :; do echo x >> /workspace/calc/noise.txt; "
                               "cp /workspace/calc/core.py /workspace/calc/copy.py; done) "
                               ">/dev/null 2>&1 &")
    try:
        v = grade("task/calc-empty", sb.id, store=tasks.store, node_dir=tasks.node)
        assert not v.passed and v.tests["tests/test_hidden.py::test_empty"] == "failed"
        assert sb.exec("test -s /workspace/calc/noise.txt").exit_code == 0  # still running
        again = grade("task/calc-empty", sb.id, store=tasks.store, node_dir=tasks.node)
        assert not again.passed
    finally:
        sb.close()


def test_a_huge_snapshot_is_graded_on_what_it_may_change(tasks):
    sb = _agent(tasks, BROKEN, "dd if=/dev/urandom of=/root/huge bs=1M count=200 2>/dev/null")
    try:
        snap = sb.pack_diff("snap/huge-agent")
    finally:
        sb.close()
    assert snap.size > 150 << 20
    v = grade("task/calc-empty", "snap/huge-agent", store=tasks.store, node_dir=tasks.node)
    assert not v.passed and v.source == snap.lock
    assert _dropped(v)["/root/huge"] == "outside the editable paths"


def test_a_snapshot_of_another_env_is_refused(tasks):
    from envbuild.errors import RuntimeShimError

    tasks.write("envs/pyhost-only.yaml", """\
        apiVersion: envbuild/v1
        kind: Env
        name: pyhost-only
        base: pyhost
        """)
    tasks.cli("build", "pyhost-only")
    with pytest.raises(RuntimeShimError, match="not a snapshot of the task's env lock"):
        grade("task/calc-empty", "env/pyhost-only", store=tasks.store, node_dir=tasks.node)


def test_a_solution_that_never_ends_times_out_and_fails(tasks):
    """The grade command runs under the task's timeout: a solution that loops forever (or a
    test run it stalls) is a failed verdict with ``timed_out``, and nothing is left running."""
    from runtime_shim.node import TaskSpec, load_task, publish_task

    base = load_task(tasks.store, "task/calc-empty")
    spec = TaskSpec(**{**base.spec.__dict__, "name": "calc-quick", "timeout": 3.0})
    publish_task(tasks.store, spec, base.hidden, ref="task/calc-quick")
    sb = _agent(tasks, "def mean(xs):\n    while True:\n        pass\n")
    started = time.monotonic()
    v = _graded(tasks, sb, "task/calc-quick")
    assert not v.passed and v.timed_out and v.exit_code is None
    assert v.reason == "the grade command timed out; no JUnit report; 3 named test(s) did not pass: " \
        "tests/test_hidden.py::test_empty (missing), tests/test_hidden.py::test_one (missing), " \
        "tests/test_core.py::test_mean (missing)"
    assert time.monotonic() - started < 30


def test_fifos_and_setuid_bits_in_the_editable_paths_are_listed(tasks):
    """pack-diff's policy still runs on what the filter keeps: a FIFO is dropped and a setuid
    bit stripped, and both are in ``dropped`` with the honest solution still passing."""
    sb = _agent(tasks, HONEST, "mkfifo /workspace/calc/pipe && cp /workspace/calc/core.py "
                               "/workspace/calc/suid.py && chmod 4755 /workspace/calc/suid.py")
    v = _graded(tasks, sb)
    assert v.passed, v.output
    dropped = _dropped(v)
    assert dropped["/workspace/calc/pipe"] == "dropped by the snapshot policy: fifo"
    assert dropped["/workspace/calc/suid.py"] == "stripped by the snapshot policy: setuid"
