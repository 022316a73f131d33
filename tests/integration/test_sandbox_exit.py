"""A process's sandboxes when it exits (issue 34, item 9): harnesses such as mini-swe-agent
close their sandbox in ``__del__``, which at interpreter exit runs with imports gone
(``sys.meta_path is None``) and no new thread able to run; and a process that exits without
closing its sandboxes (not ``keep``) must not leave them until some later create or gc.

Each test runs a real Python process that creates a real container sandbox (runc, overlay,
scratch disk on a loop device) on a node dir of its own, then checks what is left under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime_shim.isolation.runc import OciRuntime, list_containers
from runtime_shim.node import diskpool
from runtime_shim.sdk.sandbox import list_sandboxes, remove_sandbox
from tests.integration.conftest import build_busybox_env
from tests.leftovers import leftovers_under

ENV = "busybox-shell"
REPO = Path(__file__).resolve().parents[2]
#: How long an exiting owner may take (a close costs well under a second here).
EXIT_BOUND = 30.0
#: How soon after a killed owner its sandboxes must be gone (a removal takes ~0.1-0.5 s).
REMOVAL_BOUND = 15.0


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("sandbox-exit"))


@pytest.fixture
def node(tmp_path):
    """A node dir of the test's own, so what is left under it is this test's; whatever a
    failed test left is removed afterwards."""
    node = tmp_path / "node"
    yield node
    for info in list_sandboxes(node):
        remove_sandbox(node, info.id)


def _left(node: Path, ids: list[str] = ()) -> dict[str, list[str]]:
    """Everything of a sandbox still on the host under ``node``: mounts, loop devices,
    processes, runc state and sandbox dirs (scratch disks live in the sandbox dirs), and the
    cgroups of the sandboxes ``ids``. The disk pool a removal in this process left in its
    grace is unmounted first (``diskpool.unmount_all_idle``, as this process's exit would);
    the owners' own pools are not: they must have gone with them."""
    diskpool.unmount_all_idle()
    left = leftovers_under(node)
    left["runc state"] = [c["id"] for c in list_containers(OciRuntime(state_root=str(node / "runc")))]
    sandboxes = node / "sandboxes"
    left["sandbox dirs"] = sorted(os.listdir(sandboxes)) if sandboxes.is_dir() else []
    left["cgroups"] = [cg for i in ids for cg in _cgroups(i)]
    return left


def _cgroups(sandbox_id: str) -> list[str]:
    found = []
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        for hierarchy in (os.listdir(root) if os.path.isdir(root) else []):
            for cg in (os.path.join(root, "envbuild", sandbox_id),
                       os.path.join(root, hierarchy, "envbuild", sandbox_id)):
                if os.path.exists(cg):
                    found.append(cg)
    return sorted(set(found))


NOTHING = {"mounts": [], "loop devices": [], "processes": [], "runc state": [],
           "sandbox dirs": [], "cgroups": []}


def _owner_script(built, node: Path, body: str) -> str:
    store, _ = built
    return (
        "import atexit, os, signal, sys, time\n"
        "from envbuild.store import LocalStore\n"
        "from runtime_shim.sdk.sandbox import Sandbox\n"
        f"def create(**kw):\n"
        f"    return Sandbox.create({ENV!r}, store=LocalStore({str(store.root)!r}),"
        f" node_dir={str(node)!r}, **kw)\n" + body)


def _run(code: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=EXIT_BOUND, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the owner did not exit within {EXIT_BOUND} s (hung in close at exit?): "
                    f"{e.stderr!r}")


# The harness's pattern: the sandbox lives in an object whose __del__ closes it, and that
# object is a global of __main__, destroyed while the interpreter finalizes.
HARNESS = """
class Environment:
    def __init__(self):
        self.sb = create(network=NETWORK)
    def __del__(self):
        self.sb.close()
env = Environment()
assert env.sb.exec('echo hi').stdout == b'hi\\n'
print(env.sb.id, flush=True)
"""

# Without the exit hook (as if the sandbox outlived it): close runs during finalization itself.
NO_HOOK = """
try:
    from runtime_shim.isolation import lifecycle
except ImportError:
    pass
else:
    atexit.unregister(lifecycle.close_at_exit)
"""


@pytest.mark.parametrize("network", [False, True])
@pytest.mark.parametrize("hook", ["with-exit-hook", "close-while-finalizing"])
def test_close_in_del_at_interpreter_exit(built, node, hook, network):
    """The harness's object is destroyed at exit: the process exits within the bound, no
    "Exception ignored in __del__", nothing of the sandbox is left (with ``network``: its
    slirp4netns and namespace too)."""
    started = time.monotonic()
    body = f"NETWORK = {network}\n" + HARNESS + (NO_HOOK if hook != "with-exit-hook" else "")
    done = _run(_owner_script(built, node, body))
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("eb-"), done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr
    assert took < EXIT_BOUND
    assert _left(node, [done.stdout.strip()]) == NOTHING


def test_exit_without_close_removes_the_sandbox(built, node):
    """Neither close nor ``with``: the process returns from its script, and the sandbox goes
    with it (no create or gc after it)."""
    done = _run(_owner_script(built, node, "sb = create()\nprint(sb.id, flush=True)\n"))
    assert done.returncode == 0, done.stderr
    assert _left(node, [done.stdout.strip()]) == NOTHING


def test_kept_sandbox_outlives_its_owner(built, node):
    done = _run(_owner_script(built, node, "sb = create(keep=True)\nprint(sb.id, flush=True)\n"))
    assert done.returncode == 0, done.stderr
    sandbox_id = done.stdout.strip()
    time.sleep(1.0)
    assert [i.id for i in list_sandboxes(node)] == [sandbox_id]
    assert _cgroups(sandbox_id)  # what _left looks for is there while it lives
    remove_sandbox(node, sandbox_id)
    assert _left(node, [sandbox_id]) == NOTHING


@pytest.mark.parametrize("death", ["SIGKILL", "os._exit"])
def test_killed_owner_sandboxes_go_without_another_create(built, node, death):
    """The owner dies running no hook (SIGKILL, or ``os._exit``): its sandboxes are removed
    soon after, though nothing else happens on the node; its kept one stays."""
    end = ("os._exit(0)\n" if death == "os._exit" else "time.sleep(600)\n")
    code = _owner_script(built, node, "a = create()\nb = create(network=True)\n"
                                      "k = create(keep=True)\n"
                                      "print(a.id, b.id, k.id, flush=True)\n" + end)
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        ids = owner.stdout.readline().split()
        assert len(ids) == 3, ids
        if death == "SIGKILL":
            owner.send_signal(signal.SIGKILL)
        owner.wait(EXIT_BOUND)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    kept = ids[2]
    deadline = time.monotonic() + REMOVAL_BOUND
    while time.monotonic() < deadline and [i.id for i in list_sandboxes(node)] != [kept]:
        time.sleep(0.1)
    assert [i.id for i in list_sandboxes(node)] == [kept]
    remove_sandbox(node, kept)
    assert _left(node, ids) == NOTHING
