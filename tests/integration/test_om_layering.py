"""The layering that makes O(m) real (issue 17 item 2), counted through ``envbuild build --json``
with real runc builds: toolkits and workspaces build on an ABI, so

- an agent/toolkit change costs one build and re-locks every env that stacks it,
- a change of m bases costs m builds and re-locks every env,
- a workspace change costs one build and re-locks exactly the envs that use it,

where a per-instance image scheme (the agent layer on top of each instance image) rebuilds
every image above the change. Builds are counted, not timed.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ABI = "bb-agent"
BASES = ("base-a", "base-b")
WORKSPACES = ("task-one", "task-two", "task-three")
AGENT = "agent"
# one env per (base, workspace): the matrix a harness would build an image for, each with the agent
ENVS = {f"{ws}-on-{b[-1]}": (b, ws) for b in BASES for ws in WORKSPACES}
LAYERS = (*BASES, *WORKSPACES, AGENT)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def write_tree(defs: Path, *, base_rev: str = "r1", agent_rev: str = "v1",
               ws_rev: dict[str, str] | None = None) -> None:
    ws_rev = ws_rev or {}
    for b in BASES:
        _write(defs / "base" / f"{b}.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Base
            name: {b}
            abi: {ABI}
            from: {{busybox: {{binary: /bin/busybox}}}}
            steps:
              - run: mkdir -p /etc /tmp && echo "{b} {base_rev}" > /etc/base-id
                network: none
            config:
              env: {{PATH: /usr/sbin:/usr/bin:/sbin:/bin}}
            """)
    for ws in WORKSPACES:
        _write(defs / "workspaces" / f"{ws}.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Workspace
            name: {ws}
            build_on: base-a
            source: {{path: ../../sources/{ws}}}
            dest: /workspace
            steps:
              - run: echo "{ws} {ws_rev.get(ws, 'c1')}" > /workspace/commit
                network: none
            check:
              - grep -q '^{ws} ' /workspace/commit && agent --version | grep -q '^agent '
            """)
        src = defs.parent / "sources" / ws
        src.mkdir(parents=True, exist_ok=True)
        (src / "README").write_text(f"{ws}\n")
    _write(defs / "toolkits" / f"{AGENT}.yaml", f"""\
        apiVersion: envbuild/v1
        kind: Toolkit
        name: {AGENT}
        build_on: base-b
        prefix: /opt/agent
        steps:
          - run: |
              set -eu
              mkdir -p /opt/agent/bin
              printf '#!/bin/sh\\necho agent {agent_rev}\\n' > /opt/agent/bin/agent
              chmod 0755 /opt/agent/bin/agent
            network: none
        config:
          env: {{PATH: /opt/agent/bin:$PATH}}
        """)
    for env, (b, ws) in ENVS.items():
        _write(defs / "envs" / f"{env}.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Env
            name: {env}
            base: {b}
            workspace: {ws}
            toolkits: [{AGENT}]
            config: {{workdir: /workspace}}
            """)


def built(result) -> set[str]:
    assert result.code == 0, result.err
    return {lay["name"] for lay in result.json()["layers"] if lay["status"] == "built"}


def locks(result) -> dict[str, str]:
    return {lk["env"]: lk["digest"] for lk in result.json()["locks"]}


def test_agent_base_and_workspace_changes_cost_one_m_and_one_builds(envbuild_cli, tmp_path):
    defs = tmp_path / "om2" / "envdefs"
    cli = lambda *a: envbuild_cli(*a, defs=defs)  # noqa: E731
    write_tree(defs)
    first = cli("build", "--json")
    assert built(first) == set(LAYERS)
    before = locks(first)
    assert set(before) == set(ENVS) and all(before.values())

    # 1. the agent toolkit changes: one build; every env (all stack the agent) re-locked
    write_tree(defs, agent_rev="v2")
    agent = cli("build", "--json")
    assert built(agent) == {AGENT}
    after_agent = locks(agent)
    assert all(after_agent[e] != before[e] for e in ENVS)
    shown = cli("run", "task-two-on-a", "--", "agent", "--version")
    assert shown.code == 0 and shown.out.strip() == "agent v2", shown.out + shown.err

    # 2. both bases change (m = 2, same abi): two builds; every env re-locked
    write_tree(defs, agent_rev="v2", base_rev="r2")
    base = cli("build", "--json")
    assert built(base) == set(BASES)
    after_base = locks(base)
    assert all(after_base[e] != after_agent[e] for e in ENVS)

    # 3. one workspace (task) changes: one build; exactly the envs that use it re-locked
    write_tree(defs, agent_rev="v2", base_rev="r2", ws_rev={"task-two": "c2"})
    task = cli("build", "--json")
    assert built(task) == {"task-two"}
    after_task = locks(task)
    for env, (_, ws) in ENVS.items():
        assert (after_task[env] != after_base[env]) == (ws == "task-two"), env

    # every env still passes its check against the new layers, and nothing is left to build
    checked = cli("check", "--jobs", "2")
    assert checked.code == 0, checked.out + checked.err
    assert checked.out.splitlines()[-1] == f"{len(ENVS)} passed, 0 failed"
    assert built(cli("build", "--json")) == set()

    # and the planner agrees: every layer cached
    plan = cli("plan", "--json")
    assert plan.code == 0 and {lay["status"] for lay in json.loads(plan.out)["layers"]} == \
        {"cached"}
