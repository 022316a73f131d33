"""Fixtures for tests against real tools: runc, overlayfs, skopeo, umoci.

``envbuild_cli`` runs the real CLI in-process (``envbuild.cli.main.main``) with its own store and
node cache, so tests see exactly what a user sees (exit code, stdout, stderr) without paying
for a Python start-up per call.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, require_root, require_tool


@dataclasses.dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


@dataclasses.dataclass
class Env:
    store: Path
    node: Path
    defs: Path
    monkeypatch: pytest.MonkeyPatch
    capsys: pytest.CaptureFixture

    def __call__(self, *args: str, defs: Path | None = None) -> CliResult:
        from envbuild.cli.main import main

        self.monkeypatch.setenv("ENVBUILD_NODE_CACHE", str(self.node))
        self.monkeypatch.setenv("ENVBUILD_STORE", str(self.store))
        self.monkeypatch.setenv("ENVBUILD_DEFS", str(defs or self.defs))
        self.capsys.readouterr()
        code = main(list(args))
        captured = self.capsys.readouterr()
        return CliResult(code, captured.out, captured.err)


@pytest.fixture
def envbuild_cli(tmp_path, monkeypatch, capsys) -> Env:
    """The CLI with a fresh store and node cache, on a copy of the busybox part of envdefs/."""
    require_root()
    require_tool("runc")
    require_tool("busybox")
    defs = tmp_path / "envdefs"
    copy_busybox_defs(defs)
    return Env(store=tmp_path / "store", node=tmp_path / "node", defs=defs,
               monkeypatch=monkeypatch, capsys=capsys)


def copy_busybox_defs(dest: Path) -> None:
    """The busybox env of envdefs/ (base, kvsh workspace, shtest toolkit) with the sources it
    reads, laid out with the same relative paths so ``../../sources/kvsh`` still resolves."""
    root = dest.parent
    for rel in ("envdefs/base/busybox-tiny.yaml", "envdefs/base/files/busybox",
                "envdefs/workspaces/kvsh.yaml", "envdefs/toolkits/shtest.yaml",
                "envdefs/toolkits/files/shtest", "envdefs/envs/busybox-shell.yaml",
                "sources/kvsh"):
        src = REPO / rel
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target)
        else:
            shutil.copy2(src, target)


#: The session's one build of the busybox env (``build_busybox_env``), copied from then on.
_BUSYBOX_TEMPLATE: list[Path] = []


def build_busybox_env(root: Path):
    """The busybox env of envdefs/ built and locked under ``root``; returns
    ``(LocalStore, node_dir)``. For module-scoped fixtures whose tests share one built store.
    The first call of a session builds it with the real CLI (a fresh process, as a user
    would) into a template; every call copies the template's defs, sources and store under
    ``root`` (what the build made, byte for byte) and gives it a fresh node dir."""
    import atexit
    import tempfile

    from envbuild.store import LocalStore

    require_root()
    require_tool("runc")
    require_tool("busybox")
    if not _BUSYBOX_TEMPLATE:
        template = Path(tempfile.mkdtemp(prefix="envbuild-busybox-template-"))
        atexit.register(shutil.rmtree, template, True)
        _cli_build_busybox(template)
        _BUSYBOX_TEMPLATE.append(template)
    for part in _BUSYBOX_TEMPLATE[0].iterdir():
        if part.name != "node":
            shutil.copytree(part, root / part.name, symlinks=True, dirs_exist_ok=True)
    (root / "node").mkdir(exist_ok=True)
    return LocalStore(root / "store"), root / "node"


def _cli_build_busybox(root: Path) -> None:
    import os
    import subprocess
    import sys

    copy_busybox_defs(root / "envdefs")
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(root / "node"),
           "ENVBUILD_STORE": str(root / "store"), "ENVBUILD_DEFS": str(root / "envdefs")}
    proc = subprocess.run([sys.executable, "-m", "envbuild.cli", "build"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


@dataclasses.dataclass
class ExampleBuild:
    """``envdefs/`` built once on the session's Ray cluster into S3 (``cluster_examples``):
    the driver's and the second machine's ``--json`` reports, and that machine's local store
    (every layer and env ref pulled with ``--cache-from``), which other tests reuse."""

    report: dict
    pulled: dict
    url: str
    endpoint: str
    local_store: Path
    defs: Path
    node_template: str
    seconds: float
    stderr: str


#: The example tree's parts, copied with their relative paths (``../../sources/...``).
EXAMPLE_PARTS = ("envdefs/base", "envdefs/envs", "envdefs/toolkits", "envdefs/workspaces",
                 "envdefs/README.md", "sources")
RAY_FORWARD = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
               "AWS_EC2_METADATA_DISABLED", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


@pytest.fixture(scope="session")
def cluster_examples(ray_cluster, tmp_path_factory):
    """The session's one build of the example envdefs (``envdefs/``: busybox, the debootstrap
    base, the Python base, its workspaces and toolkits, every env), done on the shared Ray
    cluster (``envbuild build --executor ray``, 2 builder nodes, each its own node cache) into
    moto S3 over HTTP; then a second machine (an empty local store and node cache,
    ``--cache-from`` the bucket) builds nothing and pulls it all. Tests that need a built
    Python env use that local store instead of building one of their own."""
    import os
    import subprocess
    import sys
    import time

    from envbuild.build.reaper import reap_stale_builds
    from runtime_shim.isolation.runc import OciRuntime
    from tests.store.s3server import CREDENTIALS, MotoServer

    require_root()
    for tool in ("runc", "busybox", "debootstrap"):
        require_tool(tool)
    root = tmp_path_factory.mktemp("examples")
    for rel in EXAMPLE_PARTS:
        src, target = REPO / rel, root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, target)
    moto = MotoServer().start()
    node_template = str(root / "node-{node_id}")
    try:
        url = f"s3://{moto.make_bucket()}/examples"
        env = {**os.environ, **CREDENTIALS, "PYTHONPATH": str(REPO), "ENVBUILD_STORE": url,
               "ENVBUILD_S3_ENDPOINT": moto.endpoint, "ENVBUILD_DEFS": str(root / "envdefs"),
               "ENVBUILD_NODE_CACHE": node_template, "RAY_ADDRESS": ray_cluster.address}
        env.pop("AWS_ENDPOINT_URL", None)
        fwd = [a for n in RAY_FORWARD for a in ("--ray-env", n)]
        started = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "envbuild.cli", "build", "--executor", "ray",
                            "--ray-address", ray_cluster.address, *fwd, "--json"],
                           env=env, capture_output=True, text=True, timeout=1800)
        seconds = time.monotonic() - started
        assert r.returncode == 0, r.stderr[-4000:]
        local = root / "b-store"
        pull_env = {**env, "ENVBUILD_STORE": str(local), "ENVBUILD_NODE_CACHE": str(root / "b-node")}
        b = subprocess.run([sys.executable, "-m", "envbuild.cli", "--cache-from", url, "build",
                            "--json"], env=pull_env, capture_output=True, text=True, timeout=900)
        assert b.returncode == 0, b.stderr[-4000:]
        yield ExampleBuild(report=json.loads(r.stdout), pulled=json.loads(b.stdout), url=url,
                           endpoint=moto.endpoint, local_store=local, defs=root / "envdefs",
                           node_template=node_template, seconds=seconds, stderr=r.stderr)
    finally:
        moto.kill()
        for node in root.glob("node-*"):  # nothing should be there; a failed build's, if any
            reap_stale_builds(node / "builds", OciRuntime("runc", state_root=str(node / "runc")))


def python_example_store(request):
    """A store with the example envs' Debian layers (env/py-textstats built):
    $ENVBUILD_TEST_PY_STORE, the repo's cache/, else the session's one build of the examples
    (``cluster_examples``: on the Ray cluster, pulled into a local store; debootstrap, a few
    minutes, shared with the other tests that need it)."""
    import os

    from envbuild.store import LocalStore

    for where in (os.environ.get("ENVBUILD_TEST_PY_STORE"), str(REPO / "cache")):
        if where and os.path.isdir(where):
            candidate = LocalStore(where)
            try:
                candidate.get_ref("env/py-textstats")
                return candidate
            except Exception:  # noqa: BLE001 - not built there
                pass
    return LocalStore(request.getfixturevalue("cluster_examples").local_store)


@pytest.fixture(scope="module")
def e2b_built(tmp_path_factory):
    """The busybox env built into a store of its own, for one module's ``envbuild serve``."""
    root = tmp_path_factory.mktemp("e2b")
    store, node = build_busybox_env(root)
    return root, store, node


@pytest.fixture(scope="module")
def e2b_server(e2b_built):
    """``envbuild serve`` over ``e2b_built``'s store, with the e2b SDK's variables pointing at it."""
    yield from serving(e2b_built)


def serving(built):
    """``envbuild serve`` over ``built`` (``e2b_built``'s triple) with the e2b SDK's variables
    set, for a fixture of any scope to ``yield from``."""
    from tests.e2b_server import e2b_env, running_server

    root, store, node = built
    with running_server(root, store.root, node) as srv, e2b_env(srv):
        yield srv


@pytest.fixture
def e2b_sandbox(e2b_server):
    """A sandbox of ``TEMPLATE`` made by the e2b SDK on ``e2b_server``, killed after the test."""
    from e2b import Sandbox

    from tests.e2b_server import TEMPLATE

    sb = Sandbox.create(TEMPLATE, timeout=120)
    yield sb
    sb.kill()

