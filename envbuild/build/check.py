"""``envbuild check``: run every workspace's ``check:`` commands in each env that uses it.

This is how a base that broke its ABI contract is caught: workspaces are reused across base
updates (the O(m) rule), so after re-locking, each env runs its workspace's checks in a real
sandbox over the new lock (no network, default limits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from envbuild.build.pin import Snapshot
from envbuild.defs.model import Env, Workspace
from envbuild.errors import BuildError
from envbuild.store import Store


@dataclasses.dataclass(frozen=True)
class CheckResult:
    env: str
    workspace: str
    command: str
    exit_code: int
    output: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def run_checks(project: Snapshot, store: Store, node_dir: Path, envs: Iterable[str] | None = None,
               *, runtime: str = "runc", timeout: float = 300.0) -> list[CheckResult]:
    from runtime_shim.sandbox import Sandbox

    names = list(envs) if envs else sorted(e.name for e in project.graph.defs.envs)
    results = []
    for name in names:
        env = project.graph[name] if name in project.graph.defs.by_name else None
        if not isinstance(env, Env):
            raise BuildError(f"no env named {name!r}",
                             hint="envbuild graph lists the envs")
        ws = project.graph[env.workspace] if env.workspace else None
        if not isinstance(ws, Workspace) or not ws.check:
            continue
        with Sandbox.create(f"env/{name}", store=store, node_dir=node_dir,
                            runtime=runtime) as sb:
            for command in ws.check:
                r = sb.exec(command, timeout=timeout)
                output = (r.stdout + r.stderr).decode(errors="replace")
                results.append(CheckResult(name, ws.name, command, r.exit_code, output,
                                           r.duration))
    return results
