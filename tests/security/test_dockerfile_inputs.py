"""Attacks through a Dockerfile base (issue 17): a context whose symlinks point at host files,
a context or Dockerfile outside the repository, a huge context, and a saved image whose layer
escapes the root or does not match its config. Each with the secure outcome asserted against
the real daemon (envbuild's private dockerd) or the real importer."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from envbuild.build.dockerfile import import_docker_archive
from envbuild.errors import BuildError, UnsafeLayerError
from tests.conftest import require_root, require_tool
from tests.integration.test_dockerfile_base import (
    _assert_daemon_gone,
    _error,
    _ours,
    _require_docker,
)

BASE = """\
apiVersion: envbuild/v1
kind: Base
name: hostile
abi: hostile-1
from:
  dockerfile:
    context: {context}
{extra}"""


def _defs(envbuild_cli, context: str = "ctx", extra: str = "") -> Path:
    defs = envbuild_cli.defs
    (defs / "base" / "hostile.yaml").write_text(BASE.format(context=context, extra=extra))
    return defs


def _layer_bytes(store_root: Path) -> bytes:
    """Every layer blob of the store, decompressed and concatenated."""
    import zstandard

    out = b""
    for p in (store_root / "blobs").rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            if data[:4] == b"\x28\xb5\x2f\xfd":
                out += zstandard.ZstdDecompressor().stream_reader(
                    io.BytesIO(data), read_across_frames=True).read()
    return out


def test_context_symlinks_to_host_files_never_bring_the_host_file(envbuild_cli, tmp_path,
                                                                    monkeypatch):
    _require_docker()
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    secret_dir = Path(f"/tmp/h17-dockerfile-secret-{uuid.uuid4().hex[:8]}")
    secret_dir.mkdir()
    marker = f"HOST-SECRET-{uuid.uuid4().hex}".encode()
    (secret_dir / "secret").write_bytes(marker)
    try:
        ctx = envbuild_cli.defs / "base" / "ctx"
        ctx.mkdir(parents=True)
        os.symlink(secret_dir / "secret", ctx / "leak")
        os.symlink(secret_dir, ctx / "hostdir")
        os.symlink("../../../../../../../../" + str(secret_dir).lstrip("/") + "/secret",
                   ctx / "dotdot")
        (ctx / "Dockerfile").write_text("FROM scratch\nCOPY . /ctx/\n")
        defs = _defs(envbuild_cli)
        before = _ours()
        r = envbuild_cli("build", "hostile", defs=defs)
        # BuildKit sends links as links: the layer holds the links, never what they name.
        assert r.code == 0, r.err
        _assert_daemon_gone(envbuild_cli.node, before)
        assert marker not in _layer_bytes(envbuild_cli.store)
        for p in (envbuild_cli.node).rglob("*"):
            if p.is_file() and not p.is_symlink() and p.stat().st_size < (1 << 20):
                assert marker not in p.read_bytes(), p

        # COPY of a link itself is resolved inside the context, where the target is missing
        (ctx / "Dockerfile").write_text("FROM scratch\nCOPY leak /leak\n")
        r = envbuild_cli("build", "hostile", defs=defs)
        assert r.code == 1, r.err
        assert "docker build failed" in _error(r.err) and "not found" in _error(r.err)
        assert marker not in _layer_bytes(envbuild_cli.store)
        _assert_daemon_gone(envbuild_cli.node, before)
    finally:
        shutil.rmtree(secret_dir)


def test_context_or_dockerfile_outside_the_repository_is_refused(envbuild_cli, tmp_path):
    require_root()
    outside = tmp_path.parent / f"{tmp_path.name}-outside"  # beside the repository, not in it
    outside.mkdir()
    (outside / "Dockerfile").write_text("FROM scratch\n")
    base = envbuild_cli.defs / "base"
    os.symlink(outside, base / "ctx-link")
    r = envbuild_cli("plan", defs=_defs(envbuild_cli, "ctx-link"))
    assert r.code == 1 and "outside the source root" in _error(r.err), r.err

    r = envbuild_cli("plan", defs=_defs(envbuild_cli, str(outside)))
    assert r.code == 1 and "outside the source root" in _error(r.err), r.err

    ctx = base / "ctx"
    ctx.mkdir()
    r = envbuild_cli("plan", defs=_defs(envbuild_cli, "ctx",
                                        f"    file: ../../../{'../' * 10}{outside}/Dockerfile\n"))
    assert r.code == 1 and "outside the source root" in _error(r.err), r.err

    os.symlink(outside / "Dockerfile", ctx / "Dockerfile")
    r = envbuild_cli("plan", defs=_defs(envbuild_cli))
    assert r.code == 1 and "Dockerfile Dockerfile is a symlink, refused" in _error(r.err), r.err


def test_a_huge_context_is_refused_at_planning_without_reading_it(envbuild_cli):
    require_root()
    ctx = envbuild_cli.defs / "base" / "ctx"
    ctx.mkdir(parents=True)
    (ctx / "Dockerfile").write_text("FROM scratch\nCOPY . /\n")
    with open(ctx / "huge.bin", "wb") as f:
        f.truncate(17 << 30)  # sparse: 17 GiB of zeros that would take ~15 s to hash
    started = time.monotonic()
    r = envbuild_cli("plan", defs=_defs(envbuild_cli))
    assert time.monotonic() - started < 5
    assert r.code == 1
    line = _error(r.err)
    assert "holds more than 16384 MiB of files" in line, r.err
    assert ".dockerignore" in r.err  # the hint
    (ctx / ".dockerignore").write_text("huge.bin\n")
    r = envbuild_cli("plan", defs=_defs(envbuild_cli))
    assert r.code == 0, r.err


def test_option_like_args_and_targets_are_refused_by_the_schema(envbuild_cli):
    require_root()
    (envbuild_cli.defs / "base" / "ctx").mkdir(parents=True)
    for extra in ("    target: --output=type=local,dest=/\n", "    args: {'--x': y}\n",
                  "    network: default\n"):
        r = envbuild_cli("plan", defs=_defs(envbuild_cli, "ctx", extra))
        assert r.code == 1 and "Traceback" not in r.err, r.err


def _archive(path: Path, layers: list[bytes], diff_ids: list[str] | None = None) -> None:
    import hashlib

    ids = diff_ids or ["sha256:" + hashlib.sha256(b).hexdigest() for b in layers]
    config = json.dumps({"config": {"Env": ["A=1"]}, "rootfs": {"type": "layers",
                                                                 "diff_ids": ids}}).encode()
    with tarfile.open(path, "w") as t:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))

        names = [f"l{i}/layer.tar" for i in range(len(layers))]
        add("manifest.json", json.dumps([{"Config": "c.json", "RepoTags": None,
                                          "Layers": names}]).encode())
        add("c.json", config)
        for n, b in zip(names, layers):
            add(n, b)


def _layer(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_saved_image_whose_layer_escapes_or_lies_is_refused(tmp_path):
    require_root()
    require_tool("tar")
    dest = tmp_path / "root"
    bad = tmp_path / "escape.tar"
    _archive(bad, [_layer([("../escaped", b"x")])])
    with pytest.raises(UnsafeLayerError):
        import_docker_archive(bad, dest, "hostile: image")
    assert not (tmp_path / "escaped").exists()

    lying = tmp_path / "lying.tar"
    _archive(lying, [_layer([("ok", b"x")])], ["sha256:" + "0" * 64])
    with pytest.raises(BuildError, match="does not hash to its diff_id"):
        import_docker_archive(lying, tmp_path / "root2", "hostile: image")

    good = tmp_path / "good.tar"
    _archive(good, [_layer([("etc/ok", b"fine")])])
    imported = import_docker_archive(good, tmp_path / "root3", "image")
    assert (tmp_path / "root3" / "etc" / "ok").read_bytes() == b"fine"
    assert imported.env == {"A": "1"}


def test_add_of_a_host_loopback_url_is_refused_before_any_daemon_runs(envbuild_cli):
    """``ADD http://127.0.0.1:…`` would be fetched by the daemon itself, on the host's network
    (past ``network: none``, into the host's loopback services) and outside the key: refused
    at planning, as is an unpinned ``COPY --from=IMAGE:TAG``."""
    require_root()
    ctx = envbuild_cli.defs / "base" / "ctx"
    ctx.mkdir(parents=True)
    (ctx / "Dockerfile").write_text("FROM scratch\nADD http://127.0.0.1:9/secret /s\n")
    r = envbuild_cli("build", "hostile", defs=_defs(envbuild_cli))
    assert r.code == 1 and "ADD of a URL" in _error(r.err), r.err
    assert not (envbuild_cli.node / "node" / "dockerd").exists()
    (ctx / "Dockerfile").write_text("FROM scratch\nCOPY --from=busybox:latest /bin /bin\n")
    r = envbuild_cli("build", "hostile", defs=_defs(envbuild_cli))
    assert r.code == 1 and "FROM busybox:latest names a tag" in _error(r.err), r.err


def network_host_probes(envbuild_cli, targets: dict[str, tuple[str, int]],
                        answer: str) -> dict[str, str]:
    """Build a Dockerfile base with ``network: host`` whose one RUN step sends a GET to each
    ``name: (addr, port)`` of ``targets``; ``{name: "open" | "refused"}`` (open: the answer
    held ``answer``). The step fails on purpose (exit 9) so its output is in the error's tail;
    the build leaves no daemon behind."""
    probes = " ; ".join(
        # nc, not wget: the static busybox's wget crashes in a rootfs without a libc
        f"(printf 'GET / HTTP/1.0\\r\\n\\r\\n' | timeout 5 nc {addr} {port} 2>/dev/null"
        f" | grep -q '{answer}' && echo {name}=open || echo {name}=refused)"
        for name, (addr, port) in targets.items())
    ctx = envbuild_cli.defs / "base" / "ctx"
    ctx.mkdir(parents=True)
    shutil.copy2("/bin/busybox", ctx / "busybox")
    (ctx / "Dockerfile").write_text(
        "FROM scratch\nCOPY busybox /bin/busybox\nSHELL [\"/bin/busybox\", \"sh\", \"-c\"]\n"
        f"RUN /bin/busybox --install -s /bin && ({probes}) && exit 9\n")
    before = _ours()
    r = envbuild_cli("build", "hostile", defs=_defs(envbuild_cli, "ctx", "    network: host\n"))
    assert r.code == 1, r.err  # exit 9: the probes' output is in the error's tail
    _assert_daemon_gone(envbuild_cli.node / "node", before)
    return dict(re.findall(r"^#\d+ [\d.]+ ([a-z0-9-]+)=(open|refused)$", r.err, re.M))


def test_network_host_is_egress_not_the_host(envbuild_cli, host_services, remote_host,  # noqa: F811
                                             monkeypatch):
    """``network: host`` in a Dockerfile base (untrusted input, like any definition): a RUN
    step reaches a remote host, but not the host's loopback, the slirp gateway or the host's
    own address — the private daemon runs in its own namespace behind slirp4netns."""
    _require_docker()
    from runtime_shim.isolation import netns
    from tests.security.test_network import REMOTE_ADDR, _host_address

    monkeypatch.delenv("DOCKER_HOST", raising=False)
    port = host_services
    got = network_host_probes(envbuild_cli, {
        "lo": ("127.0.0.1", port), "gw": (netns.SLIRP_GATEWAY, port),
        "eth": (_host_address(), port), "remote": (REMOTE_ADDR, remote_host[0])}, " 200 ")
    assert got == {"lo": "refused", "gw": "refused", "eth": "refused", "remote": "open"}


from tests.security.test_network import host_services, remote_host  # noqa: E402,F401 (fixtures)


def test_a_build_that_prints_forever_is_logged_up_to_the_cap(envbuild_cli, monkeypatch):
    """The build's output goes to a host log outside any capped disk: capped like a run
    step's (``BUILD_LOG_CAP``, lowered here): its head and tail kept, the rest dropped."""
    _require_docker()
    from envbuild.build import buildlog

    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setattr(buildlog, "BUILD_LOG_CAP", 200_000)
    ctx = envbuild_cli.defs / "base" / "ctx"
    ctx.mkdir(parents=True)
    shutil.copy2("/bin/busybox", ctx / "busybox")
    (ctx / "Dockerfile").write_text(
        "FROM scratch\nCOPY busybox /bin/busybox\nSHELL [\"/bin/busybox\", \"sh\", \"-c\"]\n"
        "RUN /bin/busybox --install -s /bin && for i in $(seq 40); do "
        "yes $i-line-of-output | head -c 400000; echo; done\n")
    r = envbuild_cli("build", "hostile", defs=_defs(envbuild_cli))
    assert r.code == 0, r.err
    (log,) = (envbuild_cli.store / "logs").glob("hostile-*.log")
    text = log.read_bytes()
    assert len(text) <= 200_000, len(text)
    # the head and the tail (what came after the flood: the save and unpack lines) are kept
    assert b"output trimmed here" in text and b"=== docker save took" in text[-1000:]
