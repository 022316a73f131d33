"""The O(m) rule end to end (DESIGN.md, "Identity, keys and the O(m) rule"), with real runc.

Two busybox bases offer the same abi; three workspaces and two toolkits are built on them and
stacked into five envs that mix both bases. Updating both bases' steps (same abi) must cost
exactly two layer builds, re-lock every env onto the new base digests with every other layer
digest unchanged, and the workspaces' ``check:`` commands must pass against the new bases.
Changing one base's abi instead rebuilds exactly the layers built on it.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from envbuild.store import LocalStore

ABI = "bb-om"
BASES = ("bb-a", "bb-b")
# workspace -> base it is built on
WORKSPACES = {"ws-one": "bb-a", "ws-two": "bb-b", "ws-three": "bb-a"}
TOOLKITS = {"tk-red": "bb-a", "tk-blue": "bb-b"}
# env -> (base, workspace, toolkits): every workspace and toolkit is used over both bases
ENVS = {
    "env-1": ("bb-a", "ws-one", ["tk-red"]),
    "env-2": ("bb-b", "ws-one", ["tk-blue"]),
    "env-3": ("bb-b", "ws-two", ["tk-red", "tk-blue"]),
    "env-4": ("bb-a", "ws-two", []),
    "env-5": ("bb-a", "ws-three", ["tk-blue"]),
    "env-6": ("bb-b", "ws-three", ["tk-red"]),
}
LAYERS = (*BASES, *WORKSPACES, *TOOLKITS)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def write_tree(defs: Path, *, revision: str, abis: dict[str, str] | None = None,
               requires: list[str] | None = None) -> None:
    """(Re)write the whole definition tree; ``revision`` goes into both bases' run step."""
    abis = {b: ABI for b in BASES} | (abis or {})
    # One line either way, so dedent() sees the same indentation on every line.
    req = f"requires: {{abi: {json.dumps(requires)}}}" if requires else "description: O(m) test"
    for base in BASES:
        # A tool of the base (/usr/bin/base-info) that the workspace checks call: the checks
        # prove each env runs on a base that still provides what the workspace relies on.
        _write(defs / "base" / f"{base}.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Base
            name: {base}
            abi: {abis[base]}
            from: {{busybox: {{binary: /bin/busybox}}}}
            steps:
              - run: |
                  set -eu
                  mkdir -p /etc /usr/bin /tmp
                  echo "{base} {revision}" > /etc/base-id
                  printf '#!/bin/sh\\ncat /etc/base-id\\n' > /usr/bin/base-info
                  chmod 0755 /usr/bin/base-info
                network: none
            config:
              env: {{PATH: /usr/sbin:/usr/bin:/sbin:/bin, HOME: /root}}
            """)
    for ws, base in WORKSPACES.items():
        src = defs.parent / "sources" / ws
        _write(src / "data.txt", f"payload of {ws}\n")
        _write(src / "expect", f"payload of {ws}\n")
        _write(defs / "workspaces" / f"{ws}.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Workspace
            name: {ws}
            build_on: {base}
            {req}
            source: {{path: ../../sources/{ws}}}
            dest: /workspace
            steps:
              - run: sha256sum /workspace/data.txt > /workspace/data.sha256
                network: none
            check:
              - cd /workspace && sha256sum -c data.sha256 && cmp data.txt expect
              - base-info | grep -Eq '^bb-(a|b) r[0-9]+$'
            """)
    for tk, base in TOOLKITS.items():
        _write(defs / "toolkits" / f"{tk}.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Toolkit
            name: {tk}
            build_on: {base}
            {req}
            prefix: /opt/toolkits/{tk}
            steps:
              - run: |
                  set -eu
                  mkdir -p /opt/toolkits/{tk}/bin
                  printf '#!/bin/sh\\necho {tk} "$@"\\n' > /opt/toolkits/{tk}/bin/{tk}
                  chmod 0755 /opt/toolkits/{tk}/bin/{tk}
                network: none
            config:
              env: {{PATH: /opt/toolkits/{tk}/bin:$PATH}}
            """)
    for env, (base, ws, tks) in ENVS.items():
        _write(defs / "envs" / f"{env}.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Env
            name: {env}
            base: {base}
            workspace: {ws}
            toolkits: {json.dumps(tks)}
            config: {{workdir: /workspace, user: "0:0"}}
            """)


def lock_layers(store: LocalStore, env: str) -> dict[str, str]:
    """layer name -> layer digest, read from the env's stored lock manifest."""
    manifest = json.loads(store.blob_path(store.get_ref(f"env/{env}").digest).read_bytes())
    return {lay["annotations"]["org.envbuild.name"]: lay["digest"] for lay in manifest["layers"]}


def statuses(result) -> dict[str, str]:
    assert result.code in (0, 1), result.err
    return {lay["name"]: lay["status"] for lay in result.json()["layers"]}


def test_base_updates_cost_m_builds_and_relock_every_env(envbuild_cli, tmp_path):
    defs = tmp_path / "om" / "envdefs"
    write_tree(defs, revision="r1")
    cli = lambda *a: envbuild_cli(*a, defs=defs)  # noqa: E731

    first = cli("build", "--json")
    assert first.code == 0, first.err
    assert statuses(first) == {n: "built" for n in LAYERS}
    assert {lk["env"] for lk in first.json()["locks"] if lk["digest"]} == set(ENVS)
    store = LocalStore(envbuild_cli.store)
    before = {env: lock_layers(store, env) for env in ENVS}
    checked = cli("check")
    assert checked.code == 0, checked.out + checked.err
    assert f"{2 * len(ENVS)} passed, 0 failed" in checked.out

    # m = 2 base updates, same abi: 2 builds, everything else reused.
    write_tree(defs, revision="r2")
    second = cli("build", "--json")
    assert second.code == 0, second.err
    assert statuses(second) == {n: ("built" if n in BASES else "cached") for n in LAYERS}
    assert sum(s == "built" for s in statuses(second).values()) == len(BASES)
    after = {env: lock_layers(store, env) for env in ENVS}
    new_base = {lay["name"]: lay["digest"] for lay in second.json()["layers"]}
    for env, (base, ws, tks) in ENVS.items():
        assert list(after[env]) == [base, ws, *tks]  # layer order of the lock
        assert after[env][base] != before[env][base], env
        assert after[env][base] == new_base[base]
        for name in (ws, *tks):
            assert after[env][name] == before[env][name], (env, name)
    # Each env's ref moved to a new lock.
    assert {lk["env"]: lk["digest"] for lk in first.json()["locks"]}.keys() == set(ENVS)
    for old, new in zip(first.json()["locks"], second.json()["locks"]):
        assert old["env"] == new["env"] and old["digest"] != new["digest"]

    checked = cli("check")
    assert checked.code == 0, checked.out + checked.err
    assert f"{2 * len(ENVS)} passed, 0 failed" in checked.out
    shown = cli("run", "env-4", "base-info")  # really the new base under a reused workspace
    assert shown.code == 0 and shown.out.strip() == "bb-a r2", shown.out + shown.err

    third = cli("build", "--json")
    assert set(statuses(third).values()) == {"cached"}

    # A new abi for bb-a (the layers admit it): what is built on bb-a rebuilds, nothing else —
    # bb-a's own key does not contain its abi, so bb-a itself stays cached.
    write_tree(defs, revision="r2", abis={"bb-a": "bb-om-2"}, requires=[ABI, "bb-om-2"])
    fourth = cli("build", "--json")
    assert fourth.code == 0, fourth.err
    on_a = {n for n, b in {**WORKSPACES, **TOOLKITS}.items() if b == "bb-a"}
    assert statuses(fourth) == {n: ("built" if n in on_a else "cached") for n in LAYERS}
    checked = cli("check")
    assert checked.code == 0, checked.out + checked.err
