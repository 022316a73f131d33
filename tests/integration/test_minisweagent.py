"""mini-swe-agent end to end (issue 35 item 5): its own agent loop (``DefaultAgent``, its
default config's templates) with its ``DeterministicModel``, in an ``EnvbuildEnvironment``
loaded by dotted path, on a real task built from PyPI sdists into a git workspace, graded by
``runtime_shim.grade``.

The task: more-itertools 10.3.0's ``seekable.relative_seek`` seeks from the end of its cache,
not from the current position; 10.5.0 fixed it, with the test
``tests/test_more.py::SeekableTest::test_relative_seek``. A local git repo holds 10.3.0's sdist
tree (the pinned commit) and 10.5.0's after it; the env's workspace is that commit with
``dotgit: true`` on the ``pyhost`` Python base (``tests/py_env.py``); the task's hidden layer is
10.5.0's ``tests/test_more.py`` (the same file as the SWE example's
``tasks/hidden/more-itertools-relative-seek``), ``editable`` the package dir. The Task
definition is built and locked with the real CLI (``envbuild build``, ``envbuild lock TASK``).

An honest run reads the code, applies 10.5.0's fix, shows ``git diff`` and submits: passed. A
cheater replaces ``python3`` with a script printing a passing pytest line (which fools any
check run in its own sandbox) and plants a ``conftest.py`` that skips every test: not passed,
both in ``dropped``.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

from runtime_shim import Sandbox, grade
from tests.conftest import REPO, require_root, require_tool
from tests.integration.test_importers import _git
from tests.py_env import PyTree, make_py_tree

pytestmark = pytest.mark.slow

PACKAGE = "more-itertools"
OLD, NEW = "10.3.0", "10.5.0"
SDISTS_TXT = REPO / "envdefs/examples/swe/sdists.txt"
EXAMPLE_HIDDEN = REPO / "envdefs/examples/swe/tasks/hidden/more-itertools-relative-seek"
TASK = "more-itertools-relative-seek"
TEST_FILE = "tests/test_more.py"
TEST_ID = f"{TEST_FILE}::SeekableTest::test_relative_seek"
JUNIT = "/tmp/envbuild-grade/junit.xml"
RUN = f"python3 -m pytest -q -p no:cacheprovider --junitxml={JUNIT} {TEST_ID}"
ENV_CLASS = "envbuild.harness.minisweagent.EnvbuildEnvironment"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git add -A && git diff --cached"
OLD_CODE = "        index = len(self._cache)\n        self.seek(max(index + count, 0))\n"
NEW_CODE = ("        if self._index is None:\n            self._index = len(self._cache)\n\n"
            "        self.seek(max(self._index + count, 0))\n")


def _pinned_sha256(spec: str) -> str:
    """The sha256 ``envdefs/examples/swe/sdists.txt`` pins for ``NAME==VERSION``."""
    for line in SDISTS_TXT.read_text().splitlines():
        if line.split()[:1] == [spec]:
            return line.split()[1]
    raise AssertionError(f"{spec} is not in {SDISTS_TXT}")


def _sdist_tree(version: str, cache: Path) -> Path:
    """The sdist of ``PACKAGE==version`` from PyPI (source only, sha256-checked), unpacked."""
    spec = f"{PACKAGE}=={version}"
    tarball = cache / f"{PACKAGE}-{version}.tar.gz"
    if not tarball.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", "-d", str(cache), spec],
                       check=True, capture_output=True, timeout=300)
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    assert digest == _pinned_sha256(spec), f"{tarball.name}: sha256 {digest}"
    out = cache / f"tree-{version}"
    with tarfile.open(tarball) as tar:
        tar.extractall(out, filter="data")
    (top,) = out.iterdir()
    return top


def _git_repo(root: Path, old: Path, new: Path) -> tuple[Path, str, str]:
    """A repo whose first commit is ``old``'s tree and second ``new``'s: (repo, old, new)."""
    repo = root / "repo"
    shutil.copytree(old, repo)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"{PACKAGE} {OLD}")
    pinned = _git(repo, "rev-parse", "HEAD")
    for p in repo.iterdir():
        if p.name != ".git":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    shutil.copytree(new, repo, dirs_exist_ok=True)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"{PACKAGE} {NEW}: relative_seek from the current position")
    return repo, pinned, _git(repo, "rev-parse", "HEAD")


def _write_defs(tree: PyTree, pinned: str, hidden: bytes) -> None:
    tree.write("workspaces/mi.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Workspace
        name: mi
        build_on: pyhost
        source: {{git: {{url: "../../repo", rev: {pinned}, dotgit: true}}}}
        dest: /workspace
        """)
    tree.write("envs/py-more-itertools.yaml", """\
        apiVersion: envbuild/v1
        kind: Env
        name: py-more-itertools
        base: pyhost
        workspace: mi
        config: {workdir: /workspace}
        """)
    (tree.defs / "tasks/hidden" / TASK / "tests").mkdir(parents=True)
    (tree.defs / "tasks/hidden" / TASK / TEST_FILE).write_bytes(hidden)
    tree.write(f"tasks/{TASK}.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Task
        name: {TASK}
        env: py-more-itertools
        workdir: /workspace
        hidden: {{path: hidden/{TASK}}}
        editable: [more_itertools]
        grade: {{run: "{RUN}", timeout: 300}}
        tests: {{must_pass: ["{TEST_ID}"]}}
        junit: {JUNIT}
        """)


@pytest.fixture(scope="module")
def swe_task(tmp_path_factory) -> dict[str, Any]:
    """The built env and the published task lock (module docstring)."""
    require_root()
    require_tool("runc")
    require_tool("git")
    root = tmp_path_factory.mktemp("minisweagent")
    cache = root / "sdists"
    cache.mkdir()
    old, new = _sdist_tree(OLD, cache), _sdist_tree(NEW, cache)
    hidden = (new / TEST_FILE).read_bytes()
    assert hidden == (EXAMPLE_HIDDEN / TEST_FILE).read_bytes()  # the example's is N+1's file
    assert OLD_CODE in (old / "more_itertools/more.py").read_text()
    assert NEW_CODE in (new / "more_itertools/more.py").read_text()
    tree = make_py_tree(root)
    repo, pinned, fix = _git_repo(root, old, new)
    _write_defs(tree, pinned, hidden)
    tree.cli("validate")
    tree.cli("build", "py-more-itertools", TASK)   # the env, the hidden layer, the task lock
    tree.cli("lock", TASK)
    old_test = hashlib.sha256((old / TEST_FILE).read_bytes()).hexdigest()
    return {"tree": tree, "pinned": pinned, "fix": fix, "old_test": old_test}


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """mini-swe-agent, imported quietly (no banner, its config dir under tmp)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MSWEA_SILENT_STARTUP", "1")
    mp.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path_factory.mktemp("mswea-config")))
    import minisweagent

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["harness"]
    assert f"mini-swe-agent=={minisweagent.__version__}" in extra, (
        "the installed mini-swe-agent is not the version envbuild[harness] pins: "
        "run scripts/setup.sh")
    yield minisweagent
    mp.undo()


def _run_agent(mini, swe_task, commands: list[str], tmp_path: Path) -> tuple[Any, dict]:
    """mini-swe-agent's ``DefaultAgent`` with a ``DeterministicModel`` answering
    ``commands`` one per step, in an environment made from its config by dotted path; the
    environment (sandbox still open, for grading) and the run's result."""
    import yaml
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel, make_output

    tree = swe_task["tree"]
    config = yaml.safe_load((Path(mini.package_dir) / "config/default.yaml").read_text())
    env = get_environment({"environment_class": ENV_CLASS, "lock": f"task/{TASK}",
                           "store": str(tree.store_dir), "node_dir": str(tree.node),
                           "timeout": 120, "network": False,
                           "env": {"PAGER": "cat", "PYTHONDONTWRITEBYTECODE": "1"}})
    outputs = [make_output(f"THOUGHT: step {i}\n\n```mswea_bash_command\n{c}\n```", [{"command": c}])
               for i, c in enumerate(commands)]
    agent = DefaultAgent(DeterministicModel(outputs=outputs), env,
                         **{**config["agent"], "step_limit": len(commands) + 1, "cost_limit": 0,
                            "output_path": tmp_path / "trajectory.json"})
    result = agent.run(f"Fix seekable.relative_seek in {PACKAGE} {OLD}: it seeks from the "
                       "end of the cache, not from the current position.")
    return env, {"result": result, "messages": agent.messages}


def _observations(run: dict) -> list[str]:
    return [m["content"] for m in run["messages"] if m.get("role") == "user"][1:]


HONEST = [
    "grep -n 'def relative_seek' -A3 more_itertools/more.py",
    "python3 - <<'EOF'\nimport pathlib\np = pathlib.Path('more_itertools/more.py')\n"
    f"s = p.read_text()\nassert s.count({OLD_CODE!r}) == 1\n"
    f"p.write_text(s.replace({OLD_CODE!r}, {NEW_CODE!r}))\nEOF",
    "git diff",
    "python3 -c 'import more_itertools as m; s = m.seekable(\"abcde\"); s.relative_seek(2); "
    "next(s); s.relative_seek(-2); next(s); s.relative_seek(-2); print(next(s))'",
    SUBMIT,
]

FAKE_PYTHON = "#!/bin/sh\necho '==================== 1 passed in 0.01s ===================='\nexit 0\n"
SKIP_ALL = ("import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
            "    for item in items:\n        item.add_marker(pytest.mark.skip(reason='x'))\n")
CHEATER = [
    f"rm /usr/bin/python3 && cat > /usr/bin/python3 <<'EOF' && chmod 755 /usr/bin/python3\n"
    f"{FAKE_PYTHON}EOF",
    f"cat > conftest.py <<'EOF'\n{SKIP_ALL}EOF",
    f"python3 -m pytest -q {TEST_ID}",
    SUBMIT,
]


def test_workspace_is_the_pinned_commit_and_the_fix_is_not_in_it(mini, swe_task):
    from envbuild.harness.minisweagent import EnvbuildEnvironment

    tree = swe_task["tree"]
    # a trainer's own sandbox of the task (the agent's env, no hidden layer), handed over
    with Sandbox.create(f"task/{TASK}", store=tree.store_dir, node_dir=tree.node) as sb:
        env = EnvbuildEnvironment(sandbox=sb, timeout=60)

        def run(command: str) -> dict:
            return env.execute({"command": command})

        assert env.sandbox_id == sb.id
        assert env.interpreter == ("/bin/sh", "-c")  # pyhost has busybox sh, no bash
        assert run("git rev-parse HEAD")["output"].strip() == swe_task["pinned"]
        assert run("git status --porcelain") == {"output": "", "returncode": 0,
                                                 "exception_info": ""}
        assert run("git log --all --format=%H")["output"].split() == [swe_task["pinned"]]
        assert run(f"git cat-file -e {swe_task['fix']}")["returncode"] != 0
        assert run("git rev-list --all | xargs git grep -c 'self._index + count'")["output"] == ""
        # the hidden test is not in the agent's env: its test file is 10.3.0's, whose
        # test_relative_seek lacks the assertion 10.5.0 added and passes on the bug
        assert run(f"sha256sum {TEST_FILE}")["output"].split()[0] == swe_task["old_test"]
        visible = run(f"python3 -m pytest -q -p no:cacheprovider {TEST_ID}")
        assert visible["returncode"] == 0 and "1 passed" in visible["output"], visible
        assert run("ls /tmp/envbuild-grade")["returncode"] != 0
        # stderr in the order written; a command past its timeout is returncode -1
        assert run("echo 1; echo 2 >&2; echo 3")["output"] == "1\n2\n3\n"
        slow = env.execute({"command": "echo started; sleep 30"}, timeout=2)
        assert slow["returncode"] == -1 and slow["output"] == "started\n", slow
        assert "timed out after 2 seconds" in slow["exception_info"]
        env.close()  # not its sandbox: still open
        assert run("true")["returncode"] == 0
    assert run("true")["returncode"] == -1  # closed by its owner: an error, not a crash


def test_honest_run_passes(mini, swe_task, tmp_path):
    env, run = _run_agent(mini, swe_task, HONEST, tmp_path)
    try:
        assert run["result"]["exit_status"] == "Submitted", run["messages"][-1]
        obs = _observations(run)
        assert "def relative_seek(self, count):" in obs[0]
        assert "+        self.seek(max(self._index + count, 0))" in obs[2]
        assert "<output>\na\n</output>" in obs[3]  # the fix works in the agent's sandbox
        assert "+            self._index = len(self._cache)" in run["result"]["submission"]
        tree = swe_task["tree"]
        verdict = grade(f"task/{TASK}", env.sandbox_id, store=tree.store_dir,
                        node_dir=tree.node)
    finally:
        env.close()
    assert verdict.passed is True, (verdict.reason, verdict.output)
    assert verdict.exit_code == 0 and dict(verdict.tests) == {TEST_ID: "passed"}
    assert not [d for d in verdict.dropped if d["path"].startswith("/workspace/more_itertools")]


def test_cheater_fails_with_the_cheats_dropped(mini, swe_task, tmp_path):
    env, run = _run_agent(mini, swe_task, CHEATER, tmp_path)
    try:
        assert run["result"]["exit_status"] == "Submitted", run["messages"][-1]
        # in its own sandbox the cheat works: the hidden-test command "passes"
        assert "1 passed" in _observations(run)[2] and "<returncode>0" in _observations(run)[2]
        tree = swe_task["tree"]
        verdict = grade(f"task/{TASK}", env.sandbox_id, store=tree.store_dir,
                        node_dir=tree.node)
    finally:
        env.close()
    assert verdict.passed is False, verdict
    # the env's python3 ran the hidden test on 10.3.0's code: it fails
    assert dict(verdict.tests) == {TEST_ID: "failed"}, verdict.output
    dropped = {d["path"] for d in verdict.dropped}
    assert {"/usr/bin/python3", "/workspace/conftest.py"} <= dropped, verdict.dropped
