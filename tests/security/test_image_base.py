"""Attacks on ``from: {image: …}`` bases (issue 16, item 4), against the real
``docker-registry`` behind a tampering proxy: a layer blob altered on the wire, and a registry
that is not there. Each build fails with one line and exit 1, and nothing is published: no
base layer, no lock."""

from __future__ import annotations

import json

from tests.integration.test_image_base import _build, _defs, pushed  # noqa: F401  (fixture)
from tests.store.registry_server import TamperingProxy, free_port


def _published(root) -> list[str]:
    index = root / "store" / "index.json"
    if not index.exists():
        return []
    return [m["annotations"]["org.opencontainers.image.ref.name"]
            for m in json.loads(index.read_text())["manifests"]]


def test_a_layer_altered_on_the_wire_fails_the_build(pushed, tmp_path):  # noqa: F811
    host, index, _ = pushed
    hit = []

    def tamper(method, path, status, headers, body):
        if method == "GET" and "/blobs/" in path and len(body) > 100_000:
            hit.append(path)
            body = bytearray(body)
            body[len(body) // 2] ^= 0xFF
            body = bytes(body)
        return status, headers, body

    with TamperingProxy(host, tamper) as proxy:
        proc = _build(tmp_path, _defs(tmp_path, f"{proxy.host}/base/bb@{index}"))
    assert hit, "the big layer was never fetched through the proxy"
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"error: image {proxy.host}/base/bb@{index}: blob sha256:" in proc.stderr
    assert "is corrupt: its content hashes to" in proc.stderr
    assert not any(r.startswith("env/") for r in _published(tmp_path))


def test_a_registry_that_is_down_is_one_line(tmp_path):
    gone = f"127.0.0.1:{free_port()}"
    digest = "sha256:" + "ab" * 32
    proc = _build(tmp_path, _defs(tmp_path, f"{gone}/base/bb@{digest}"))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert gone in proc.stderr
    assert not any(r.startswith("env/") for r in _published(tmp_path))


def test_a_digest_the_registry_does_not_have_is_one_line(pushed, tmp_path):  # noqa: F811
    host, _, _ = pushed
    digest = "sha256:" + "cd" * 32
    proc = _build(tmp_path, _defs(tmp_path, f"{host}/base/bb@{digest}"))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"error: image {host}/base/bb@{digest}: blob {digest} is not in {host}/base/bb" \
        in proc.stderr
