"""mini-swe-agent's environment on an envbuild sandbox: ``EnvbuildEnvironment``.

mini-swe-agent (PyPI ``mini-swe-agent``, tested with the version ``envbuild[harness]`` pins)
loads its environment class by dotted path from its config::

    environment:
      environment_class: envbuild.harness.minisweagent.EnvbuildEnvironment
      lock: task/NAME              # an env ref, a task ref (the agent's env) or a lock digest
      store: /srv/envbuild-store   # default: $ENVBUILD_STORE, else ./cache
      timeout: 60                  # per command, seconds
      network: false               # any other key is a SandboxOptions field
      limits: {memory_bytes: 4294967296}

The class follows mini-swe-agent's environment protocol as its ``DockerEnvironment`` does:
``execute(action, cwd="", *, timeout=None)`` runs ``action["command"]`` through the sandbox's
shell (``bash -lc`` when the sandbox has bash, else ``/bin/sh -c``; ``interpreter`` overrides)
under ``/bin/sh -c 'exec "$@" 2>&1'`` and returns ``{"output", "returncode",
"exception_info"}``, stderr in the output in the order it was written; a command past its
timeout, or a sandbox error, gives ``returncode`` -1 with the error in ``exception_info``, as
docker's does; an output whose first line is ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (exit
0) raises mini-swe-agent's ``Submitted`` with the rest as the submission.

Nothing the agent's commands print is a reward: grade the sandbox with ``runtime_shim.grade``
by ``EnvbuildEnvironment.sandbox_id`` (docs/harnesses.md). This module imports mini-swe-agent
only to raise ``Submitted``; the class works (and is tested) without it otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, cast

from envbuild.harness.options import sandbox_option_values, split_options
from runtime_shim import ExecResult, RuntimeShimError, Sandbox, SandboxAPI

#: the first line of a command's output that ends the agent's run (mini-swe-agent's marker)
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
BASH = ("bash", "-lc")
SH = ("/bin/sh", "-c")
#: what every command runs under: stderr onto stdout's pipe, so the output keeps the order it
#: was written in (the sandbox's exec returns the two streams apart)
MERGE = ("/bin/sh", "-c", 'exec "$@" 2>&1', "sh")


@dataclasses.dataclass(frozen=True)
class EnvbuildEnvironmentConfig:
    """The environment's own settings (the rest of mini-swe-agent's ``environment:`` mapping
    is ``options``, ``SandboxOptions`` fields). ``cwd``: where commands run ("" for the lock's
    workdir); ``env``: set for every command; ``forward_env``: names copied from this
    process's environment when set (``env`` wins); ``timeout``: seconds per command;
    ``interpreter``: the argv a command is appended to (None: ``bash -lc`` if the sandbox has
    bash, else ``/bin/sh -c``)."""

    lock: str = ""
    store: str | None = None
    node_dir: str | None = None
    cwd: str = ""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    forward_env: tuple[str, ...] = ()
    timeout: float = 30
    interpreter: tuple[str, ...] | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, fields: Mapping[str, Any]) -> EnvbuildEnvironmentConfig:
        """The config of mini-swe-agent's keyword arguments; a name that is neither ours nor a
        ``SandboxOptions`` field is a ``RuntimeShimError`` naming both lists."""
        mine, options = split_options(cls, fields)
        if mine.get("interpreter") is not None:
            mine["interpreter"] = tuple(mine["interpreter"])
        mine["forward_env"] = tuple(mine.get("forward_env") or ())
        return cls(**mine, options=options)

    def to_json(self) -> dict[str, Any]:
        """The config as mini-swe-agent's trajectories record it (JSON)."""
        doc = dataclasses.asdict(self)
        doc.update(env=dict(self.env), forward_env=list(self.forward_env),
                   interpreter=None if self.interpreter is None else list(self.interpreter))
        doc.update(doc.pop("options"))
        return doc


class EnvbuildEnvironment:
    """mini-swe-agent's environment protocol on one envbuild sandbox (module docstring).

    Either mini-swe-agent makes it from its config (keyword arguments: ``lock`` and the rest
    of ``EnvbuildEnvironmentConfig``, plus ``SandboxOptions`` fields), and it creates the
    sandbox and closes it in ``close`` / at garbage collection / at process exit; or a trainer
    passes a running ``sandbox=`` (``Sandbox.create("task/NAME")``, a fleet sandbox, a fork),
    which stays the trainer's to close."""

    def __init__(self, *, sandbox: SandboxAPI | None = None, **kwargs: Any) -> None:
        self._owned = False
        self.config = EnvbuildEnvironmentConfig.from_kwargs(kwargs)
        if sandbox is None:
            if not self.config.lock:
                raise RuntimeShimError("EnvbuildEnvironment needs a lock or a sandbox",
                                       hint="set `lock: task/NAME` (or env/NAME, a digest) in "
                                            "mini-swe-agent's environment config")
            made = Sandbox.create(self.config.lock, store=self.config.store,
                                  node_dir=self.config.node_dir,
                                  **sandbox_option_values(self.config.options))
            sandbox = cast(SandboxAPI, made)  # it is one; mypy reads pack_diff's kwargs apart
            self._owned = True
        self.sandbox: SandboxAPI = sandbox
        try:
            self.interpreter = self.config.interpreter or shell_of(sandbox)
        except BaseException:
            self.close()
            raise

    @property
    def sandbox_id(self) -> str:
        """The sandbox's id: what ``runtime_shim.grade(task, sandbox_id)`` grades."""
        return self.sandbox.id

    def execute(self, action: dict[str, Any], cwd: str = "", *,
                timeout: float | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in the sandbox; mini-swe-agent's output dict."""
        command = str(action.get("command", ""))
        limit = timeout or self.config.timeout
        try:
            result = self.sandbox.exec([*MERGE, *self.interpreter, command], timeout=limit,
                                       env=self._env(), cwd=cwd or self.config.cwd or None)
        except RuntimeShimError as e:
            output = error_output(e)
        else:
            output = exec_output(command, limit, result)
        check_finished(output)
        return output

    def _env(self) -> dict[str, str]:
        forwarded = {k: os.environ[k] for k in self.config.forward_env if k in os.environ}
        return {**forwarded, **self.config.env}

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """What mini-swe-agent's templates may use: the config, the kernel's uname (the
        default templates print ``system release version machine``), the sandbox id."""
        u = os.uname()
        uname = {"system": u.sysname, "node": u.nodename, "release": u.release,
                 "version": u.version, "machine": u.machine}
        return {**self.config.to_json(), **uname, "sandbox_id": self.sandbox_id, **kwargs}

    def serialize(self) -> dict[str, Any]:
        """The environment as mini-swe-agent's trajectory records it."""
        cls = type(self)
        return {"info": {"config": {
            "environment": {**self.config.to_json(), "sandbox_id": self.sandbox_id},
            "environment_type": f"{cls.__module__}.{cls.__name__}"}}}

    def close(self) -> None:
        """Close the sandbox if this environment created it. Idempotent."""
        if self._owned:
            self._owned = False
            self.sandbox.close()

    cleanup = close  # mini-swe-agent's name (its docker environment's)

    def __enter__(self) -> EnvbuildEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_owned", False):
            self.close()


def shell_of(sandbox: SandboxAPI) -> tuple[str, ...]:
    """``bash -lc`` if ``bash`` is on the sandbox's PATH, else ``/bin/sh -c`` (as
    mini-swe-agent's docker environment runs commands, on images without bash too)."""
    probe = sandbox.exec(["/bin/sh", "-c", "command -v bash"], timeout=30)
    return BASH if probe.exit_code == 0 and probe.stdout.strip() else SH


def exec_output(command: str, timeout: float, result: ExecResult) -> dict[str, Any]:
    """mini-swe-agent's output dict of one finished exec (its stdout, which has the
    command's stderr too, then what the ``MERGE`` shell itself wrote to stderr); a timed-out
    command is returncode -1 with the message subprocess's ``TimeoutExpired`` gives, as
    mini-swe-agent's docker environment reports it."""
    text = (result.stdout + result.stderr).decode("utf-8", errors="replace")
    if not result.timed_out:
        return {"output": text, "returncode": result.exit_code, "exception_info": ""}
    message = f"Command {command!r} timed out after {timeout:g} seconds"
    return {"output": text, "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {message}",
            "extra": {"exception_type": "TimeoutExpired", "exception": message}}


def error_output(error: Exception) -> dict[str, Any]:
    """mini-swe-agent's output dict of an exec the sandbox refused or lost."""
    return {"output": "", "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {error}",
            "extra": {"exception_type": type(error).__name__, "exception": str(error)}}


def check_finished(output: Mapping[str, Any]) -> None:
    """Raise mini-swe-agent's ``Submitted`` when ``output`` is a submission: its first line
    is ``SUBMIT_MARKER`` and the command exited 0; the rest of the output is submitted."""
    lines = str(output.get("output", "")).lstrip().splitlines(keepends=True)
    if not lines or lines[0].strip() != SUBMIT_MARKER or output.get("returncode") != 0:
        return
    from minisweagent.exceptions import Submitted

    submission = "".join(lines[1:])
    raise Submitted({"role": "exit", "content": submission,
                     "extra": {"exit_status": "Submitted", "submission": submission}})


__all__ = ["EnvbuildEnvironment", "EnvbuildEnvironmentConfig"]
