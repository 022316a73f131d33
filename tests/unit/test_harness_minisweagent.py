"""``envbuild.harness.minisweagent``: mini-swe-agent's environment protocol mapped onto a
sandbox, against a fake sandbox (the real agent loop on real sandboxes is
``tests/integration/test_minisweagent.py``)."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from envbuild.harness import minisweagent as harness
from envbuild.harness.minisweagent import EnvbuildEnvironment
from runtime_shim import ExecResult, Limits, RuntimeShimError, SandboxAPI, SandboxClosed

MERGE = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh"]


class FakeSandbox:
    """Records each exec; answers from ``replies`` (argv[-1] → (stdout, stderr, exit,
    timed_out), or an exception to raise)."""

    def __init__(self, *, has_bash: bool = True, replies: Mapping[str, Any] | None = None,
                 sandbox_id: str = "sb-fake-1") -> None:
        self.id = sandbox_id
        self.has_bash = has_bash
        self.replies = dict(replies or {})
        self.calls: list[dict[str, Any]] = []
        self.closed = 0

    def exec(self, cmd: str | Sequence[str], *, timeout: float | None = None,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             user: str | None = None, stdin: bytes | None = None,
             on_stdout=None, on_stderr=None, check_timeout: bool = False) -> ExecResult:
        argv = list(cmd) if not isinstance(cmd, str) else ["/bin/sh", "-c", cmd]
        self.calls.append({"argv": argv, "timeout": timeout, "env": env, "cwd": cwd})
        if argv == ["/bin/sh", "-c", "command -v bash"]:
            out = b"/usr/bin/bash\n" if self.has_bash else b""
            return ExecResult(0 if self.has_bash else 1, out, b"", 0.01)
        reply = self.replies.get(argv[-1], (b"", b"", 0, False))
        if isinstance(reply, Exception):
            raise reply
        out, err, code, timed_out = reply
        return ExecResult(code, out, err, 0.01, timed_out=timed_out)

    def read_file(self, path: str) -> bytes:
        raise NotImplementedError

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        raise NotImplementedError

    def set_network(self, network) -> None:
        raise NotImplementedError

    def pack_diff(self, publish=None, **kwargs):
        raise NotImplementedError

    def info(self):
        raise NotImplementedError

    def close(self) -> None:
        self.closed += 1


def test_fake_is_a_sandbox():
    assert isinstance(FakeSandbox(), SandboxAPI)


def test_commands_run_through_bash_lc_when_the_sandbox_has_bash():
    sb = FakeSandbox(replies={"ls": (b"a.py\n", b"", 0, False)})
    env = EnvbuildEnvironment(sandbox=sb)
    assert env.interpreter == ("bash", "-lc")
    assert env.execute({"command": "ls"}) == {"output": "a.py\n", "returncode": 0,
                                              "exception_info": ""}
    assert sb.calls[-1] == {"argv": [*MERGE, "bash", "-lc", "ls"], "timeout": 30, "env": {},
                            "cwd": None}  # None: the lock's workdir


def test_without_bash_commands_run_through_bin_sh():
    sb = FakeSandbox(has_bash=False)
    env = EnvbuildEnvironment(sandbox=sb)
    env.execute({"command": "true"})
    assert sb.calls[-1]["argv"] == [*MERGE, "/bin/sh", "-c", "true"]


def test_interpreter_from_the_config_skips_the_probe():
    sb = FakeSandbox()
    env = EnvbuildEnvironment(sandbox=sb, interpreter=["python3", "-c"])
    env.execute({"command": "print(1)"})
    assert [c["argv"] for c in sb.calls] == [[*MERGE, "python3", "-c", "print(1)"]]


def test_output_is_stdout_then_what_the_merging_shell_wrote():
    # the command's stderr is on stdout already (MERGE); stderr is the wrapper's own
    sb = FakeSandbox(replies={"x": (b"one\ntwo\n", b"sh: x: not found\n", 127, False)})
    out = EnvbuildEnvironment(sandbox=sb).execute({"command": "x"})
    assert out == {"output": "one\ntwo\nsh: x: not found\n", "returncode": 127,
                   "exception_info": ""}


def test_undecodable_output_is_replaced_not_raised():
    sb = FakeSandbox(replies={"x": (b"\xff\xfeok", b"", 0, False)})
    assert EnvbuildEnvironment(sandbox=sb).execute({"command": "x"})["output"] == "\ufffd\ufffdok"


def test_cwd_env_and_timeout_reach_the_exec(monkeypatch):
    monkeypatch.setenv("HOST_ONLY", "h")
    monkeypatch.delenv("NOT_SET", raising=False)
    sb = FakeSandbox()
    env = EnvbuildEnvironment(sandbox=sb, cwd="/workspace", env={"A": 1, "HOST_ONLY": "mine"},
                              forward_env=["HOST_ONLY", "NOT_SET"], timeout=7)
    env.execute({"command": "pwd"})
    assert sb.calls[-1] == {"argv": [*MERGE, "bash", "-lc", "pwd"], "timeout": 7,
                            "env": {"A": "1", "HOST_ONLY": "mine"}, "cwd": "/workspace"}
    env.execute({"command": "pwd"}, "/tmp", timeout=2)
    assert sb.calls[-1]["cwd"] == "/tmp" and sb.calls[-1]["timeout"] == 2
    env2 = EnvbuildEnvironment(sandbox=FakeSandbox(), forward_env=["HOST_ONLY"])
    env2.execute({"command": "pwd"})
    assert env2.sandbox.calls[-1]["env"] == {"HOST_ONLY": "h"}  # type: ignore[attr-defined]


def test_a_timeout_is_returncode_minus_one_with_the_partial_output():
    sb = FakeSandbox(replies={"sleep 9": (b"started\n", b"", 137, True)})
    out = EnvbuildEnvironment(sandbox=sb, timeout=3).execute({"command": "sleep 9"})
    assert out["returncode"] == -1 and out["output"] == "started\n"
    assert out["exception_info"] == ("An error occurred while executing the command: "
                                     "Command 'sleep 9' timed out after 3 seconds")
    assert out["extra"]["exception_type"] == "TimeoutExpired"


def test_a_sandbox_error_is_returncode_minus_one():
    sb = FakeSandbox(replies={"ls": SandboxClosed("sandbox sb-fake-1 is closed")})
    out = EnvbuildEnvironment(sandbox=sb).execute({"command": "ls"})
    assert out["returncode"] == -1 and out["output"] == ""
    assert out["exception_info"].endswith("sandbox sb-fake-1 is closed")
    assert out["extra"]["exception_type"] == "SandboxClosed"


def test_a_bug_is_not_swallowed():
    sb = FakeSandbox(replies={"ls": ValueError("a bug")})
    with pytest.raises(ValueError, match="a bug"):
        EnvbuildEnvironment(sandbox=sb).execute({"command": "ls"})


@pytest.fixture
def fake_minisweagent(monkeypatch):
    """mini-swe-agent's exceptions module (the one name this module imports from it), so the
    fast tier needs no mini-swe-agent installed."""
    class Submitted(Exception):
        def __init__(self, *messages: dict) -> None:
            self.messages = messages
            super().__init__()

    package = types.ModuleType("minisweagent")
    exceptions = types.ModuleType("minisweagent.exceptions")
    exceptions.Submitted = Submitted  # type: ignore[attr-defined]
    package.exceptions = exceptions  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "minisweagent", package)
    monkeypatch.setitem(sys.modules, "minisweagent.exceptions", exceptions)
    return Submitted


def test_the_submit_marker_raises_submitted_with_the_rest(fake_minisweagent):
    marker = harness.SUBMIT_MARKER
    sb = FakeSandbox(replies={
        "submit": (f"\n{marker}\ndiff --git a/x b/x\n".encode(), b"", 0, False),
        "failed": (f"{marker}\n".encode(), b"", 1, False),
        "later": (f"hi\n{marker}\n".encode(), b"", 0, False)})
    env = EnvbuildEnvironment(sandbox=sb)
    with pytest.raises(fake_minisweagent) as raised:
        env.execute({"command": "submit"})
    assert raised.value.messages == ({"role": "exit", "content": "diff --git a/x b/x\n",
                                      "extra": {"exit_status": "Submitted",
                                                "submission": "diff --git a/x b/x\n"}},)
    assert env.execute({"command": "failed"})["returncode"] == 1  # not a submission
    assert env.execute({"command": "later"})["returncode"] == 0  # marker not first


class FakeSandboxClass:
    made: list[tuple[str, dict[str, Any]]] = []

    @classmethod
    def create(cls, lock: str, **kwargs: Any) -> FakeSandbox:
        cls.made.append((lock, kwargs))
        return FakeSandbox(sandbox_id="sb-made")


def test_from_the_config_it_creates_the_sandbox_and_closes_it(monkeypatch):
    monkeypatch.setattr(harness, "Sandbox", FakeSandboxClass)
    FakeSandboxClass.made.clear()
    env = EnvbuildEnvironment(lock="task/t1", store="/s", node_dir="/n", timeout=5,
                              network=["127.0.0.1/32"], limits={"memory_bytes": 1 << 30},
                              backend="container", ttl=600)
    ((lock, kwargs),) = FakeSandboxClass.made
    assert lock == "task/t1"
    assert kwargs == {"store": "/s", "node_dir": "/n", "network": ("127.0.0.1/32",),
                      "limits": Limits(memory_bytes=1 << 30), "backend": "container",
                      "ttl": 600}
    assert env.sandbox_id == "sb-made"
    sandbox = env.sandbox
    env.close()
    env.close()
    assert sandbox.closed == 1  # type: ignore[attr-defined]


def test_a_given_sandbox_stays_the_callers():
    sb = FakeSandbox()
    with EnvbuildEnvironment(sandbox=sb) as env:
        assert env.sandbox_id == "sb-fake-1"
    del env
    assert sb.closed == 0


def test_unknown_options_and_a_missing_lock_are_refused():
    with pytest.raises(RuntimeShimError, match="unknown sandbox option.*image") as raised:
        EnvbuildEnvironment(sandbox=FakeSandbox(), image="python:3.11")
    assert "network" in (raised.value.hint or "")
    with pytest.raises(RuntimeShimError, match="needs a lock or a sandbox"):
        EnvbuildEnvironment()


def test_template_vars_and_serialize_name_the_sandbox():
    env = EnvbuildEnvironment(sandbox=FakeSandbox(), lock="task/t1", network=False,
                              limits={"pids": 64})
    tv = env.get_template_vars(extra=1)
    assert tv["sandbox_id"] == "sb-fake-1" and tv["lock"] == "task/t1" and tv["extra"] == 1
    assert {"system", "release", "version", "machine"} <= set(tv)
    doc = json.loads(json.dumps(env.serialize()))
    assert doc["info"]["config"]["environment_type"] == \
        "envbuild.harness.minisweagent.EnvbuildEnvironment"
    assert doc["info"]["config"]["environment"]["sandbox_id"] == "sb-fake-1"
    assert doc["info"]["config"]["environment"]["limits"] == {"pids": 64}
