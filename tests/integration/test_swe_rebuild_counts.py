"""The SWE-shaped example's O(m) counts as a test (issue 17 items 2-3), on a reduced tree that
builds in seconds: the shape of ``envdefs/examples/swe`` (one Dockerfile base on an OS env of
the tree, built by the real private dockerd; per repo version an env
layer; per task an instance from an sdist-like tarball with ``strip_components: 1``; one agent
toolkit) on busybox instead of Debian + PyPI, measured by the example's own
``rebuild_counts.py`` (real builds of both schemes, counted through ``build --json``)."""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, require_root, require_tool

pytestmark = pytest.mark.integration

TASKS = ("alpha-1.0", "alpha-2.0", "beta-1.0")


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "rebuild_counts", REPO / "envdefs" / "examples" / "swe" / "rebuild_counts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def _sdist(path: Path, top: str) -> str:
    import hashlib

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in ((f"{top}/VERSION", f"{top}\n"),
                           (f"{top}/tests/run.sh", "test -s /workspace/VERSION\n"
                                                   "test -x /opt/swe/env/bin/deps\n"
                                                   "echo '== 2 passed in 0.01s =='\n")):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), 0o644
            tf.addfile(ti, io.BytesIO(data.encode()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def write_reduced_tree(defs: Path) -> None:
    # the example's base shape: an OS env of the tree, and the one base a Dockerfile on it
    _write(defs / "base" / "swe-os-base.yaml", """\
        apiVersion: envbuild/v1
        kind: Base
        name: swe-os-base
        abi: swe-os
        from: {busybox: {binary: /bin/busybox}}
        steps:
          - run: mkdir -p /etc /tmp
            network: none
        config:
          env: {PATH: /usr/sbin:/usr/bin:/sbin:/bin}
        """)
    _write(defs / "envs" / "swe-os.yaml", """\
        apiVersion: envbuild/v1
        kind: Env
        name: swe-os
        base: swe-os-base
        """)
    _write(defs / "base" / "swe-base.yaml", """\
        apiVersion: envbuild/v1
        kind: Base
        name: swe-base
        abi: swe-bb
        from: {dockerfile: {context: ., file: Dockerfile}}
        """)
    _write(defs / "base" / ".dockerignore", "*.yaml\n")
    _write(defs / "base" / "Dockerfile", """\
        FROM envbuild.invalid/env/swe-os
        RUN echo "swe base revision 1" > /etc/swe-base-release
        """)
    _write(defs / "files" / "agent" / "swe-agent", 'VERSION = "1"\necho "swe-agent $VERSION"\n')
    _write(defs / "toolkits" / "agent.yaml", """\
        apiVersion: envbuild/v1
        kind: Toolkit
        name: agent
        build_on: swe-base
        prefix: /opt/swe/agent
        steps:
          - run: mkdir -p /opt/swe/agent/bin
            network: none
          - copy: {src: ../files/agent/swe-agent, dest: /opt/swe/agent/bin/swe-agent, mode: "0755"}
        config:
          env: {PATH: /opt/swe/agent/bin:$PATH}
        """)
    for task in TASKS:
        sha = _sdist(defs / "sdists" / f"{task}.tar.gz", task)
        _write(defs / "toolkits" / f"env-{task}.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Toolkit
            name: env-{task}
            build_on: swe-base
            prefix: /opt/swe/env
            steps:
              - run: |
                  set -eu
                  # env revision: 1
                  mkdir -p /opt/swe/env/bin
                  printf '#!/bin/sh\\necho deps of {task}\\n' > /opt/swe/env/bin/deps
                  chmod 0755 /opt/swe/env/bin/deps
                network: none
            config:
              env: {{PATH: /opt/swe/env/bin:$PATH}}
            """)
        _write(defs / "instances" / f"inst-{task}.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Workspace
            name: inst-{task}
            build_on: swe-base
            source: {{archive: {{path: ../sdists/{task}.tar.gz, sha256: "{sha}", strip_components: 1}}}}
            dest: /workspace
            check:
              - {{run: sh /workspace/tests/run.sh, timeout: 60}}
            """)
        _write(defs / "envs" / f"task-{task}.yaml", f"""\
            apiVersion: envbuild/v1
            kind: Env
            name: task-{task}
            base: swe-base
            workspace: inst-{task}
            toolkits: [env-{task}, agent]
            config: {{workdir: /workspace}}
            """)


def test_reduced_swe_example_rebuild_counts(tmp_path, monkeypatch, capsys):
    require_root()
    require_tool("runc")
    require_tool("busybox")
    require_tool("dockerd")
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    defs = tmp_path / "swe"
    write_reduced_tree(defs)
    monkeypatch.setenv("ENVBUILD_NODE_CACHE", str(tmp_path / "node"))
    script = _load_script()
    changes = ["agent toolkit", "files/agent/swe-agent", 'VERSION = "1"', 'VERSION = "2"',
               "base", "base/Dockerfile", "revision 1", "revision 2",
               "one repo version", "toolkits/env-alpha-2.0.yaml", "env revision: 1",
               "env revision: 2"]
    argv = ["--defs", str(defs), "--work", str(tmp_path / "work"), "--json"]
    for i in range(0, len(changes), 4):
        argv += ["--change", *changes[i:i + 4]]
    capsys.readouterr()
    assert script.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    n = len(TASKS)
    init = result["initial"]
    assert result["tasks"] == n
    # OS base + Dockerfile base, n env, n inst, agent
    assert len(init["envbuild"]["built"]) == 2 + 2 * n + 1
    assert len(init["per-instance"]["built"]) == 2 + 3 * n       # the same 2, n x (env, inst, agent)
    agent, base, repo = result["changes"]

    assert agent["envbuild"]["built"] == ["agent"]
    assert len(agent["envbuild"]["relocked"]) == n
    assert sorted(agent["per-instance"]["built"]) == sorted(f"c-task-{t}-agent" for t in TASKS)
    # each of the n rebuilt agent layers is written (and would be pushed) in full
    assert agent["per-instance"]["built_bytes"] == n * agent["envbuild"]["built_bytes"] > 0
    assert agent["per-instance"]["bytes"] > 0 and agent["envbuild"]["bytes"] > 0

    assert base["envbuild"]["built"] == ["swe-base"]                # m = 1: one docker build
    assert len(base["envbuild"]["relocked"]) == n
    assert len(base["per-instance"]["built"]) == 1 + 3 * n          # every image
    assert base["per-instance"]["built_bytes"] > base["envbuild"]["built_bytes"] > 0

    assert repo["envbuild"]["built"] == ["env-alpha-2.0"]
    assert repo["envbuild"]["relocked"] == ["task-alpha-2.0"]
    assert sorted(repo["per-instance"]["built"]) == ["c-env-alpha-2.0", "c-task-alpha-2.0-agent",
                                                     "c-task-alpha-2.0-instance"]
    assert repo["per-instance"]["relocked"] == ["task-alpha-2.0"]

    # the text report renders the same run
    assert "agent toolkit" in script.render(result)


def test_reduced_swe_example_docker_mode_builds_the_chain_with_docker(tmp_path, monkeypatch,
                                                                      capsys):
    """``--docker``: the per-instance chain is also built as Dockerfiles by ``docker build`` in
    a throwaway private dockerd, in the same run; its layer cache decides what rebuilds, as a
    harness's CI would: an agent change rebuilds n images, a base change every image, where
    envbuild builds one layer each. The daemon is gone afterwards."""
    require_root()
    require_tool("runc")
    require_tool("busybox")
    require_tool("dockerd")
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    defs = tmp_path / "swe"
    write_reduced_tree(defs)
    monkeypatch.setenv("ENVBUILD_NODE_CACHE", str(tmp_path / "node"))
    script = _load_script()
    work = tmp_path / "work"
    argv = ["--defs", str(defs), "--work", str(work), "--json", "--docker",
            "--change", "agent toolkit", "files/agent/swe-agent", 'VERSION = "1"', 'VERSION = "2"',
            "--change", "base", "base/Dockerfile", "revision 1", "revision 2"]
    capsys.readouterr()
    assert script.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    n = len(TASKS)
    d0 = result["initial"]["docker"]
    assert d0["images"] == 1 + 3 * n                              # base, n x (env, inst, agent)
    assert len(d0["built"]) == d0["images"] and d0["image_bytes"] > 0
    agent, base = result["changes"]
    assert agent["envbuild"]["built"] == ["agent"]
    assert sorted(agent["docker"]["built"]) == sorted(f"swe/c-task-{t}-agent" for t in TASKS)
    assert agent["docker"]["built_bytes"] > 0
    assert base["envbuild"]["built"] == ["swe-base"]
    assert len(base["docker"]["built"]) == 1 + 3 * n                 # every image
    assert base["docker"]["built_bytes"] > agent["docker"]["built_bytes"]
    assert "docker rebuilt" in script.render(result)
    assert not list((work / "dockerd").glob("dockerd-*")), "the private dockerd is removed"
