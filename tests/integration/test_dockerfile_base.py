"""Dockerfile bases (issue 17, items 1 and 5) with the real dockerd that envbuild starts itself:
a multi-stage Dockerfile with ARG, COPY from the context, .dockerignore and a RUN under
``network: none`` builds, is imported as a base with its image config, and runs in a sandbox;
a FROM by digest from a local registry works; bad input (a failing RUN, a missing context, a
FROM tag, dockerd failing to start) is one clear line with nothing published. After every
build the private daemon is gone: no dockerd/containerd of ours, no mounts, no dirs, no
cgroups."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from envbuild.dockerd import docker_daemon, mounts_under
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_root, require_tool
from tests.integration.conftest import copy_busybox_defs

pytestmark = pytest.mark.integration

DOCKERFILE = """\
FROM scratch AS tools
COPY busybox /bin/busybox
SHELL ["/bin/busybox", "sh", "-c"]
RUN /bin/busybox --install -s /bin && mkdir -p /etc /root /tmp /home/agent \\
    && echo 'root:x:0:0:root:/root:/bin/sh' > /etc/passwd && echo 'root:x:0:' > /etc/group

FROM tools AS final
ARG GREETING=hi
COPY . /ctx/
RUN echo "$GREETING" > /greeting \\
    && (ip -o link | grep -vc ': lo:' > /links || true)
ENV FOO=bar
WORKDIR /ctx

FROM final AS unused
RUN touch /unused
"""


def _require_docker() -> None:
    require_root()
    require_tool("runc")
    require_tool("busybox")
    require_tool("dockerd")
    if not os.access("/usr/bin/docker", os.X_OK):
        pytest.fail("Debian's docker CLI (/usr/bin/docker) is missing: apt-get install docker.io")


def _ours() -> set[str]:
    """Private dockerds' traces that exist now (their exec roots in /run and cgroups)."""
    found = {str(p) for p in Path("/run").glob("envbuild-dockerd-*")}
    found |= {str(p) for p in Path("/sys/fs/cgroup").glob("*/envbuild-dockerd-*")}
    return found


def _assert_daemon_gone(node: Path, before: set[str]) -> None:
    """No process (dockerd, its containerd, shims) names the node's dockerd dir or a new
    ``/run/envbuild-dockerd-*`` exec root, nothing is mounted below them, the node holds no
    daemon dir, and no /run or cgroup trace appeared."""
    node = node.parent if node.name == "node" and node.parent.name == "node" else node
    root = node / "node" / "dockerd"  # ENVBUILD_NODE_CACHE/node is the node cache's root
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            runs = {m.decode() for m in re.findall(rb"/run/envbuild-dockerd-[0-9a-f]{12}", cmd)}
            if os.fsencode(f"{node}/") in cmd or runs - before:
                pids.append((name, cmd[:200]))
    assert not pids, pids
    new_runs = tuple(Path(p) for p in _ours() - before if p.startswith("/run/"))
    assert not mounts_under((node, *new_runs))
    assert not root.exists() or not any(root.iterdir()), list(root.iterdir())
    assert not (node / "dockerd").exists()
    assert _ours() <= before


def _assert_unpublished(store, defs: Path) -> None:
    from envbuild.build.pin import snapshot
    from envbuild.store import get_key_record

    key = snapshot(defs).keys.layers["docker-base"]
    assert get_key_record(store, key) is None, "a failed build published its layer"


def _error(err: str) -> str:
    """The one ``error:`` line of a failed CLI run (after its progress lines)."""
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def _write_defs(root: Path, dockerfile: str = DOCKERFILE, extra: str = "") -> Path:
    defs = root / "envdefs"
    if not defs.exists():  # envbuild_cli's own tmp_path already has them
        copy_busybox_defs(defs)
    ctx = defs / "base" / "docker"
    ctx.mkdir(parents=True, exist_ok=True)
    shutil.copy2("/bin/busybox", ctx / "busybox")
    (ctx / "hello.txt").write_text("hello from the context\n")
    (ctx / "secret.txt").write_text("never sent\n")
    (ctx / "build.log").write_text("ignored too\n")
    (ctx / ".dockerignore").write_text("secret.txt\n*.log\n")
    (ctx / "Dockerfile").write_text(dockerfile)
    (defs / "base" / "docker-base.yaml").write_text(textwrap.dedent("""\
        apiVersion: envbuild/v1
        kind: Base
        name: docker-base
        abi: busybox-amd64
        from:
          dockerfile:
            context: docker
            args: {GREETING: yo}
            target: final
            network: none
        """) + extra)
    (defs / "envs" / "docker-shell.yaml").write_text(textwrap.dedent("""\
        apiVersion: envbuild/v1
        kind: Env
        name: docker-shell
        base: docker-base
        workspace: kvsh
        toolkits: [shtest]
        """))
    return defs


def test_dockerfile_base_builds_with_private_dockerd_and_runs_in_a_sandbox(envbuild_cli, tmp_path,
                                                                           monkeypatch):
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    defs = _write_defs(tmp_path)
    before = _ours()
    r = envbuild_cli("build", "docker-shell", defs=defs)
    assert r.code == 0, r.err
    _assert_daemon_gone(envbuild_cli.node, before)

    from envbuild.store import LocalStore

    with Sandbox.create("env/docker-shell", store=LocalStore(envbuild_cli.store),
                        node_dir=envbuild_cli.node) as sb:
        out = sb.exec(["sh", "-c", "cat /greeting; ls -a /ctx; echo FOO=$FOO; "
                       "test -e /unused && echo UNUSED; cat /links; ls /workspace"])
        assert out.exit_code == 0, out.stderr
        text = out.stdout.decode()
    assert text.startswith("yo\n"), text                    # ARG from args
    assert "hello.txt" in text and "Dockerfile" in text     # COPY from the context
    assert "secret.txt" not in text and "build.log" not in text  # .dockerignore
    assert "FOO=bar" in text                                # the image config's Env is kept
    assert "UNUSED" not in text                             # target: final stops there
    assert re.search(r"^0$", text, re.M), text              # network: none: only lo in the RUN
    assert "kvsh" in text or "tests" in text                # the workspace sits on top

    # Unchanged: cached, no daemon started at all. An ignored file changes nothing either.
    (defs / "base" / "docker" / "secret.txt").write_text("changed\n")
    r = envbuild_cli("build", "docker-shell", defs=defs)
    assert r.code == 0, r.err
    assert not (envbuild_cli.node / "node" / "dockerd").exists() or not any(
        (envbuild_cli.node / "node" / "dockerd").iterdir())
    r = envbuild_cli("plan", defs=defs)
    assert r.code == 0, r.err
    row = next(ln.split() for ln in r.out.splitlines() if ln.split()[2:3] == ["docker-base"])
    assert row[0] == "cached", r.out


def test_failing_run_is_one_line_with_its_output_and_publishes_nothing(envbuild_cli, tmp_path,
                                                                       monkeypatch):
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    defs = _write_defs(tmp_path, DOCKERFILE.replace(
        'echo "$GREETING" > /greeting', 'echo step-output-marker && exit 7'))
    before = _ours()
    r = envbuild_cli("build", "docker-base", defs=defs)
    assert r.code == 1, r.err
    first = _error(r.err)
    assert "docker-base: docker build failed" in first and "exit code: 7" in first, r.err
    assert "step-output-marker" in r.err          # the step's output tail
    assert "Traceback" not in r.err
    from envbuild.store import LocalStore

    _assert_unpublished(LocalStore(envbuild_cli.store), defs)
    _assert_daemon_gone(envbuild_cli.node, before)


#: What pip prints when the host's intercepting proxy meets a RUN without the host's CA bundle.
PIP_TLS_FAILURE = ("Could not fetch URL https://pypi.org/simple/six/: There was a problem confirming "
                   "the ssl certificate: HTTPSConnectionPool(host='pypi.org', port=443): "
                   "(Caused by SSLError(SSLCertVerificationError(1, '[SSL: "
                   "CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed "
                   "certificate in certificate chain (_ssl.c:1006)')))")


def test_a_run_that_distrusts_the_proxy_says_to_mount_the_ca_secret(envbuild_cli, tmp_path,
                                                                    monkeypatch):
    """A ``network: host`` RUN whose download fails on the host proxy's certificate (what a
    plain ``RUN pip install`` meets here) fails with a hint naming the secret and the mount
    every RUN that downloads needs (issue 38)."""
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    defs = _write_defs(tmp_path, DOCKERFILE.replace(
        'echo "$GREETING" > /greeting', f'echo "{PIP_TLS_FAILURE}" && exit 1'))
    yaml = defs / "base" / "docker-base.yaml"
    yaml.write_text(yaml.read_text().replace("network: none", "network: host"))
    r = envbuild_cli("build", "docker-base", defs=defs)
    assert r.code == 1, r.err
    assert "docker-base: docker build failed" in _error(r.err), r.err
    assert "RUN --mount=type=secret,id=envbuild-host-ca,target=/etc/ssl/certs/ca-certificates.crt" \
        in r.err, r.err
    assert "every RUN that downloads" in r.err and "PIP_CERT=" in r.err, r.err


def test_missing_context_and_from_tag_are_one_line_at_planning(envbuild_cli, tmp_path):
    _require_docker()
    defs = _write_defs(tmp_path)
    shutil.rmtree(defs / "base" / "docker")
    r = envbuild_cli("build", "docker-base", defs=defs)
    assert r.code == 1
    assert "docker context docker is not a directory" in _error(r.err), r.err
    assert "Traceback" not in r.err

    defs = _write_defs(tmp_path / "tag", "FROM debian:bookworm\nRUN true\n")
    r = envbuild_cli("build", "docker-base", defs=defs)
    assert r.code == 1
    line = _error(r.err)
    assert "docker-base.yaml" in line and "FROM debian:bookworm names a tag, not a digest" in line
    assert "debian:bookworm@sha256:<digest>" in r.err


def test_dockerd_failing_to_start_shows_its_log_tail_and_a_hint(envbuild_cli, tmp_path,
                                                               monkeypatch):
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    # The real dockerd, given a flag it does not know: it prints why and exits 1.
    wrapper = tmp_path / "dockerd-broken"
    wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('dockerd')} --no-such-flag \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("ENVBUILD_DOCKERD", str(wrapper))
    defs = _write_defs(tmp_path)
    before = _ours()
    r = envbuild_cli("build", "docker-base", defs=defs)
    assert r.code == 1
    assert "dockerd exited 1 before it answered" in _error(r.err), r.err
    assert "unknown flag: --no-such-flag" in r.err   # its log tail
    assert "its log:" in r.err                       # the hint
    _assert_daemon_gone(envbuild_cli.node, before)


def test_user_daemon_at_docker_host_that_does_not_answer_is_one_line(envbuild_cli, tmp_path,
                                                                     monkeypatch):
    _require_docker()
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/nobody.sock")
    defs = _write_defs(tmp_path)
    r = envbuild_cli("build", "docker-base", defs=defs)
    assert r.code == 1
    assert "DOCKER_HOST=unix://" in _error(r.err) and "does not answer" in r.err, r.err
    assert not (envbuild_cli.node / "node" / "dockerd").exists() or not any(
        (envbuild_cli.node / "node" / "dockerd").iterdir())


def test_from_a_digest_pinned_image_in_a_local_registry(envbuild_cli, tmp_path, monkeypatch):
    """The offline way to give a Dockerfile its FROM image: push it to a registry on loopback
    (here with a throwaway daemon of ``envbuild.dockerd``), pin its digest; the tag alone is
    refused with that digest."""
    _require_docker()
    from tests.store.registry_server import running_registry

    monkeypatch.delenv("DOCKER_HOST", raising=False)
    src = tmp_path / "tools"
    src.mkdir()
    shutil.copy2("/bin/busybox", src / "busybox")
    (src / "Dockerfile").write_text("FROM scratch\nCOPY busybox /bin/busybox\n"
                                    "ENV FROM_TOOLS=1\n")
    before = _ours()
    with running_registry(tmp_path / "registry") as reg:
        ref = f"{reg.host}/tools/bb:v1"
        with docker_daemon(tmp_path / "pushd") as d:
            env = d.env()
            for argv in (["build", "--network=none", "-t", ref, str(src)], ["push", ref]):
                p = subprocess.run([d.cli, *argv], env=env, capture_output=True, text=True,
                                   timeout=180)
                assert p.returncode == 0, p.stderr + p.stdout
            m = re.search(r"digest: (sha256:[0-9a-f]{64})", p.stdout)
            assert m, p.stdout
            digest = m.group(1)
        assert not (tmp_path / "pushd").exists() or not any((tmp_path / "pushd").iterdir())
        name = ref.rsplit(":", 1)[0]

        defs = _write_defs(tmp_path / "tag", f"FROM {ref}\nRUN true\n")
        r = envbuild_cli("build", "docker-base", defs=defs)
        assert r.code == 1
        assert f"resolves to {digest}" in _error(r.err), r.err

        dockerfile = (f"FROM {name}@{digest} AS final\n"
                      'SHELL ["/bin/busybox", "sh", "-c"]\n'
                      "RUN /bin/busybox mkdir -p /etc && /bin/busybox echo pulled > /etc/marker\n")
        defs = _write_defs(tmp_path / "ok", dockerfile)
        r = envbuild_cli("build", "docker-base", defs=defs)
        assert r.code == 0, r.err
        r = envbuild_cli("explain", "docker-base", defs=defs)
        assert digest in r.out, r.out   # the FROM digest is a key input

        # network: host puts the build's daemon behind slirp (no host loopback): the image is
        # pulled first by a daemon in the host's namespace, then loaded
        defs = _write_defs(tmp_path / "host", dockerfile)
        yaml = defs / "base" / "docker-base.yaml"
        yaml.write_text(yaml.read_text().replace("network: none", "network: host"))
        r = envbuild_cli("build", "docker-base", defs=defs)
        assert r.code == 0, r.err
    _assert_daemon_gone(envbuild_cli.node, before)


def test_from_an_env_lock_of_the_envbuild_store(envbuild_cli, tmp_path, monkeypatch):
    """``FROM envbuild.invalid/env/NAME@<lock digest>``: the lock is exported from the store
    (``docker load``), so a Dockerfile can build on what envbuild already has, offline; a lock
    that moved since is refused with its current digest."""
    _require_docker()
    from envbuild.store import LocalStore

    monkeypatch.delenv("DOCKER_HOST", raising=False)
    r = envbuild_cli("build", "busybox-shell")
    assert r.code == 0, r.err
    digest = LocalStore(envbuild_cli.store).get_ref("env/busybox-shell").digest
    dockerfile = (f"FROM envbuild.invalid/env/busybox-shell@{digest} AS final\n"
                  "RUN echo built-on-the-lock > /from-lock && test -x /opt/toolkits/shtest/bin/shtest\n")
    defs = _write_defs(tmp_path, dockerfile)
    before = _ours()
    r = envbuild_cli("build", "docker-shell", defs=defs)
    assert r.code == 0, r.err
    _assert_daemon_gone(envbuild_cli.node, before)
    with Sandbox.create("env/docker-shell", store=LocalStore(envbuild_cli.store),
                        node_dir=envbuild_cli.node) as sb:
        out = sb.exec(["cat", "/from-lock"])
        assert out.stdout.decode().startswith("built-on-the-lock\n"), out

    stale = "sha256:" + "0" * 64
    defs = _write_defs(tmp_path / "stale", dockerfile.replace(digest, stale))
    r = envbuild_cli("build", "docker-base", defs=defs)
    assert r.code == 1
    assert f"env/busybox-shell is locked at {digest}, not {stale}" in _error(r.err), r.err


def test_from_an_env_of_the_tree_builds_it_first_and_keys_on_its_lock_inputs(envbuild_cli,
                                                                              tmp_path,
                                                                              monkeypatch):
    """``FROM envbuild.invalid/env/NAME`` (no digest), NAME an Env of the same tree: an edge of
    the graph, so one ``envbuild build`` from an empty store builds the env's layers, locks it,
    ``docker load``s that lock into the private daemon and builds on it; the Dockerfile base's
    key holds the env's lock inputs, not a digest, and a second build is a no-op."""
    import json

    from envbuild.store import LocalStore

    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    dockerfile = ("FROM envbuild.invalid/env/busybox-shell AS final\n"
                  "RUN echo built-on-the-env > /from-env && test -x /opt/toolkits/shtest/bin/shtest\n")
    defs = _write_defs(tmp_path, dockerfile)
    r = envbuild_cli("graph", "--format", "json", defs=defs)
    assert r.code == 0, r.err
    nodes = {n["name"]: n for n in json.loads(r.out)["nodes"]}
    assert nodes["docker-base"]["depends_on"] == ["busybox-shell"]
    r = envbuild_cli("plan", "--json", "docker-shell", defs=defs)
    assert r.code == 0, r.err
    steps = {s["name"]: s for s in json.loads(r.out)["layers"]}
    assert set(steps["docker-base"]["depends_on"]) == {"busybox-tiny", "kvsh", "shtest"}
    assert {e["name"] for e in json.loads(r.out)["envs"]} == {"docker-shell", "busybox-shell"}
    r = envbuild_cli("explain", "docker-base", defs=defs)
    assert r.code == 0 and "from_envs" in r.out, r.out

    before = _ours()
    r = envbuild_cli("build", "docker-shell", defs=defs)  # nothing built before
    assert r.code == 0, r.err
    _assert_daemon_gone(envbuild_cli.node, before)
    store = LocalStore(envbuild_cli.store)
    assert store.get_ref("env/busybox-shell").digest  # locked by the same build
    with Sandbox.create("env/docker-shell", store=store, node_dir=envbuild_cli.node) as sb:
        out = sb.exec(["cat", "/from-env"])
        assert out.stdout.decode().startswith("built-on-the-env\n"), out
    r = envbuild_cli("plan", "--json", "docker-shell", defs=defs)
    assert all(s["status"] == "cached" for s in json.loads(r.out)["layers"]), r.out
    # a change to a layer of the env moves the Dockerfile base's key (and only the env's
    # layer and it are missing)
    tk = defs / "toolkits" / "shtest.yaml"
    tk.write_text(tk.read_text().replace("description: shtest,", "description: changed,", 1))
    r = envbuild_cli("plan", "--json", "docker-shell", defs=defs)
    missing = {s["name"] for s in json.loads(r.out)["layers"] if s["status"] == "missing"}
    assert missing == set(), "a description is not in any key"
    steps_yaml = tk.read_text()
    tk.write_text(steps_yaml.replace("steps:\n", "steps:\n  - run: echo changed > /dev/null\n"
                                     "    network: none\n", 1))
    r = envbuild_cli("plan", "--json", "docker-shell", defs=defs)
    missing = {s["name"] for s in json.loads(r.out)["layers"] if s["status"] == "missing"}
    assert missing == {"shtest", "docker-base"}, r.out


def test_network_host_builds_get_the_host_ca_bundle_as_a_secret(envbuild_cli, tmp_path,
                                                                 monkeypatch):
    """With ``network: host`` a RUN can mount the host's CA bundle (the secret
    ``envbuild-host-ca``: this host reaches PyPI through an intercepting proxy only that bundle
    trusts); it is the host's bundle byte for byte, and it is not in the image."""
    from runtime_shim.isolation.stub import host_ca_bundle

    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    ca = host_ca_bundle()
    assert ca is not None, "this test needs the host's CA bundle (apt-get install ca-certificates)"
    size = os.path.getsize(ca)
    dockerfile = textwrap.dedent(f"""\
        FROM scratch AS final
        COPY busybox /bin/busybox
        RUN --mount=type=secret,id=envbuild-host-ca,target=/ca.crt ["/bin/busybox", "sh", "-c", \\
            "test $(/bin/busybox wc -c < /ca.crt) = {size} && /bin/busybox mkdir /ok"]
        RUN ["/bin/busybox", "sh", "-c", "/bin/busybox test ! -s /ca.crt && /bin/busybox test -d /ok"]
        """)
    defs = _write_defs(tmp_path, dockerfile)
    yaml = defs / "base" / "docker-base.yaml"
    yaml.write_text(yaml.read_text().replace("network: none", "network: host"))
    before = _ours()
    r = envbuild_cli("build", "docker-base", defs=defs)
    assert r.code == 0, r.err
    _assert_daemon_gone(envbuild_cli.node, before)


def test_a_build_past_its_timeout_is_stopped_and_says_so(envbuild_cli, tmp_path, monkeypatch):
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setenv("ENVBUILD_DOCKER_BUILD_TIMEOUT", "4")
    defs = _write_defs(tmp_path, DOCKERFILE.replace('echo "$GREETING" > /greeting',
                                                    "sleep 600"))
    before = _ours()
    started = time.monotonic()
    r = envbuild_cli("build", "docker-base", defs=defs)
    assert time.monotonic() - started < 60
    assert r.code == 1
    assert "docker-base: docker build timed out after 4 s" in _error(r.err), r.err
    assert "ENVBUILD_DOCKER_BUILD_TIMEOUT" in r.err
    _assert_daemon_gone(envbuild_cli.node, before)


def test_run_steps_are_confined_by_the_daemon_limits(envbuild_cli, tmp_path, monkeypatch):
    """BuildKit's RUN containers live in the private daemon's cgroup parent, which carries
    envbuild's build limits: with 40 tasks allowed, a RUN that forks 80 fails."""
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setenv("ENVBUILD_DOCKER_PIDS", "40")
    defs = _write_defs(tmp_path, DOCKERFILE.replace(
        'echo "$GREETING" > /greeting',
        "for i in $(seq 80); do sleep 30 & done; echo forked-$((40+40)); wait; exit 0"))
    before = _ours()
    r = envbuild_cli("build", "docker-base", defs=defs)
    assert r.code == 1, r.err
    assert "can't fork" in r.err or "Resource temporarily unavailable" in r.err, r.err
    assert "forked-80" not in r.err
    _assert_daemon_gone(envbuild_cli.node, before)


def test_a_user_daemon_at_docker_host_is_used_and_left_without_our_images(envbuild_cli, tmp_path,
                                                                          monkeypatch):
    """With DOCKER_HOST set, envbuild starts no daemon of its own and removes the image it
    built from the user's daemon afterwards (the user's other images stay)."""
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    defs = _write_defs(tmp_path)
    with docker_daemon(tmp_path / "users") as user:
        env = user.env()
        keep = tmp_path / "keep"
        keep.mkdir()
        (keep / "Dockerfile").write_text("FROM scratch\nLABEL mine=1\n")
        p = subprocess.run([user.cli, "build", "-q", "--network=none", "-t", "users/own:1",
                            str(keep)], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        monkeypatch.setenv("DOCKER_HOST", user.host)
        r = envbuild_cli("build", "docker-base", defs=defs)
        assert r.code == 0, r.err
        assert not (envbuild_cli.node / "node" / "dockerd").exists()  # no private daemon
        p = subprocess.run([user.cli, "images", "--format", "{{.Repository}}:{{.Tag}}"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert p.stdout.split() == ["users/own:1"], p.stdout
        assert "docker build (unix://" in (envbuild_cli.store / "logs").glob(
            "docker-base-*.log").__next__().read_text()


def test_ctrl_c_during_a_dockerfile_build_stops_the_daemon_and_leaves_nothing(tmp_path):
    """SIGINT while BuildKit runs a step: envbuild exits 1 promptly, its private dockerd (and
    containerd) are stopped and removed, nothing is published; a rerun builds."""
    _require_docker()
    import signal
    import sys

    from envbuild.store import LocalStore

    defs = _write_defs(tmp_path, DOCKERFILE.replace('echo "$GREETING" > /greeting',
                                                    "sleep 120"))
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    env.update(ENVBUILD_NODE_CACHE=str(tmp_path / "node"), ENVBUILD_STORE=str(tmp_path / "store"),
               ENVBUILD_DEFS=str(defs))
    before = _ours()
    proc = subprocess.Popen([sys.executable, "-m", "envbuild.cli", "build", "docker-base"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        logs = tmp_path / "store" / "logs"
        while time.monotonic() < deadline:  # until BuildKit runs the sleeping step
            found = list(logs.glob("docker-base-*.log")) if logs.is_dir() else []
            if found and "sleep 120" in found[0].read_text(errors="replace"):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the build never reached its RUN step")
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        _out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert time.monotonic() - started < 60
    assert proc.returncode != 0 and "Traceback" not in err, err
    _assert_daemon_gone(tmp_path / "node" / "node", before)
    _assert_daemon_gone(tmp_path / "node", before)
    _assert_unpublished(LocalStore(tmp_path / "store"), defs)


def test_two_dockerfile_bases_build_in_parallel_each_with_its_own_daemon(envbuild_cli, tmp_path,
                                                                         monkeypatch):
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    defs = _write_defs(tmp_path)
    base = defs / "base"
    (base / "docker-base-2.yaml").write_text(
        (base / "docker-base.yaml").read_text().replace("name: docker-base", "name: docker-two")
        .replace("GREETING: yo", "GREETING: two"))
    before = _ours()
    r = envbuild_cli("build", "--jobs", "2", "docker-base", "docker-two", defs=defs)
    assert r.code == 0, r.err
    logs = sorted((envbuild_cli.store / "logs").glob("docker-*.log"))
    assert len(logs) == 2 and all("=== daemon ready" in p.read_text() for p in logs)
    _assert_daemon_gone(envbuild_cli.node / "node", before)
