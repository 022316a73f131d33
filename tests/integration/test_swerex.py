"""SWE-ReX on envbuild sandboxes (issue 37 item 6): ``envbuild.harness.swerex.EnvbuildDeployment``
with SWE-ReX's own ``RemoteRuntime`` (swe-rex 1.4.0, the ``harness`` extra's pin) against the
real ``swerex-remote`` app in real runc sandboxes of the ``py-swerex`` env
(``tests/swerex_env.py``): sessions whose state persists, commands, files, uploads from this
host, a timeout that interrupts and leaves the session usable, ``stop``. SWE-ReX's own runtime
tests run against the same deployment in ``tests/integration/swerex_upstream/``; the forward's
security in ``tests/security/test_swerex_forward.py``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import pytest
from swerex.exceptions import (
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from envbuild.harness.swerex import EnvbuildDeployment
from runtime_shim import PortRefused, RuntimeShimError, Sandbox, SandboxClosed, list_sandboxes
from tests.py_env import PyTree
from tests.swerex_env import ENV

pytestmark = pytest.mark.slow
T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro
    return asyncio.run(main())


@pytest.fixture(scope="module")
def tree(swerex_tree) -> PyTree:
    tree = swerex_tree
    tree.write("envs/pyhost-only.yaml", """\
        apiVersion: envbuild/v1
        kind: Env
        name: pyhost-only
        base: pyhost
        """)
    tree.cli("build", "pyhost-only")
    return tree


@pytest.fixture
def deployment(tree):
    d = EnvbuildDeployment(lock=f"env/{ENV}", store=str(tree.store_dir), node_dir=str(tree.node))
    run(d.start())
    yield d
    run(d.stop())


def test_start_is_alive_and_stop_closes_everything(tree):
    d = EnvbuildDeployment(lock=f"env/{ENV}", store=str(tree.store_dir), node_dir=str(tree.node))
    with pytest.raises(DeploymentNotStartedError):
        run(d.is_alive())
    run(d.start())
    sandbox, port, sid = d.sandbox, d.forward.port, d.sandbox_id
    assert run(d.is_alive()).is_alive
    assert sid in {info.id for info in list_sandboxes(tree.node)}
    # the sandbox has no network of its own: only its loopback
    devices = sandbox.exec(["cat", "/proc/net/dev"]).stdout.decode()
    assert [line.split(":")[0].strip() for line in devices.splitlines()[2:]] == ["lo"]
    run(d.stop())
    with pytest.raises(DeploymentNotStartedError):
        run(d.is_alive())
    with pytest.raises(SandboxClosed):
        sandbox.exec(["true"])
    assert sid not in {info.id for info in list_sandboxes(tree.node)}
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    run(d.stop())  # idempotent


def test_session_state_persists_and_sessions_are_apart(deployment):
    r = deployment.runtime
    run(r.create_session(CreateBashSessionRequest()))
    run(r.create_session(CreateBashSessionRequest(session="other")))
    run(r.run_in_session(BashAction(command="mkdir -p /tmp/w && cd /tmp/w && export FOO=bar",
                                    check="raise")))
    obs = run(r.run_in_session(BashAction(command='pwd; echo "$FOO"; echo ${SWEREX_AUTH_TOKEN:-no}',
                                          check="raise")))
    assert obs.output == "/tmp/w\nbar\nno\n" and obs.exit_code == 0
    other = run(r.run_in_session(BashAction(command='pwd; echo "[$FOO]"', session="other")))
    assert other.output == "/workspace\n[]\n"
    failed = run(r.run_in_session(BashAction(command="false", check="silent")))
    assert failed.exit_code == 1
    with pytest.raises(NonZeroExitCodeError):
        run(r.run_in_session(BashAction(command="exit_code_7() { return 7; }; exit_code_7",
                                        check="raise")))
    run(r.close_session(CloseBashSessionRequest(session="other")))
    with pytest.raises(SessionDoesNotExistError):
        run(r.run_in_session(BashAction(command="true", session="other")))


def test_execute_a_command(deployment):
    r = deployment.runtime
    out = run(r.execute(Command(command=["sh", "-c", "echo out; echo err >&2; exit 3"])))
    assert (out.stdout, out.stderr, out.exit_code) == ("out\n", "err\n", 3)
    merged = run(r.execute(Command(command="echo a; echo b >&2", shell=True,
                                   merge_output_streams=True)))
    assert merged.stdout == "a\nb\n" and merged.stderr == ""
    cwd = run(r.execute(Command(command="pwd; echo $X", shell=True, cwd="/tmp",
                                env={"X": "y", "PATH": "/bin"})))
    assert cwd.stdout == "/tmp\ny\n"
    with pytest.raises(NonZeroExitCodeError):
        run(r.execute(Command(command="false", shell=True, check=True)))


def test_files_and_uploads_land_in_the_sandbox(deployment, tmp_path: Path):
    r, sandbox = deployment.runtime, deployment.sandbox
    run(r.write_file(WriteFileRequest(path="/workspace/new/dir/a.txt", content="héllo\n")))
    assert sandbox.read_file("/workspace/new/dir/a.txt") == "héllo\n".encode()
    assert run(r.read_file(ReadFileRequest(path="/workspace/new/dir/a.txt"))).content == "héllo\n"
    with pytest.raises(FileNotFoundError):
        run(r.read_file(ReadFileRequest(path="/workspace/none.txt")))
    one = tmp_path / "one.txt"
    one.write_text("one")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "two.txt").write_text("two")
    target = tmp_path / "target"  # a host path name, made inside the sandbox only
    run(r.upload(UploadRequest(source_path=str(one), target_path="/workspace/up/one.txt")))
    run(r.upload(UploadRequest(source_path=str(tree), target_path=str(target))))
    assert sandbox.read_file("/workspace/up/one.txt") == b"one"
    assert sandbox.read_file(f"{target}/sub/two.txt") == b"two"
    assert not target.exists()


def test_a_timeout_interrupts_and_the_session_goes_on(deployment):
    r = deployment.runtime
    run(r.create_session(CreateBashSessionRequest()))
    run(r.run_in_session(BashAction(command="export KEPT=1", check="raise")))
    with pytest.raises(CommandTimeoutError):
        run(r.run_in_session(BashAction(command="sleep 30", timeout=0.5)))
    run(r.run_in_session(BashInterruptAction()))
    obs = run(r.run_in_session(BashAction(command="echo still $KEPT", check="raise")))
    assert obs.output == "still 1\n"
    # the interrupted sleep is gone from the sandbox
    ps = deployment.sandbox.exec(["sh", "-c", "ps -o args | grep -c '^sleep 30' || true"])
    assert ps.stdout.strip() == b"0"
    with pytest.raises(CommandTimeoutError):
        run(r.execute(Command(command=["sleep", "30"], timeout=0.5)))


def test_a_trainers_sandbox_stays_open(tree):
    with Sandbox.create(f"env/{ENV}", store=tree.store_dir, node_dir=tree.node) as sb:
        d = EnvbuildDeployment(sandbox=sb, port=8123)
        run(d.start())
        assert d.sandbox_id == sb.id
        assert run(d.runtime.execute(Command(command="echo hi", shell=True))).stdout == "hi\n"
        run(d.stop())
        assert sb.exec(["true"]).exit_code == 0  # still open
        with pytest.raises(PortRefused):
            sb.connect_port(8123)  # the server is gone


def test_an_env_without_swerex_is_one_clear_error_and_nothing_is_left(tree):
    before = {info.id for info in list_sandboxes(tree.node)}
    d = EnvbuildDeployment(lock="env/pyhost-only", store=str(tree.store_dir),
                           node_dir=str(tree.node))
    with pytest.raises(RuntimeShimError, match="no swerex-remote with a Python interpreter"):
        run(d.start())
    assert {info.id for info in list_sandboxes(tree.node)} == before
    with pytest.raises(RuntimeShimError, match="needs a lock or a sandbox"):
        EnvbuildDeployment()
    with pytest.raises(RuntimeShimError, match="no_such_option"):
        EnvbuildDeployment(lock="env/x", no_such_option=1)


def test_a_server_that_exits_at_start_is_reported_with_its_log(tree):
    d = EnvbuildDeployment(lock=f"env/{ENV}", store=str(tree.store_dir),
                           node_dir=str(tree.node), python="/bin/false", startup_timeout=20)
    with pytest.raises(RuntimeShimError, match="exited"):
        run(d.start())
    with pytest.raises(DeploymentNotStartedError):
        d.sandbox  # noqa: B018 - closed again
