"""The filler's ``evict`` request (``runtime_shim.lazyfs.objgc``, ``node gc``): only layer
names, never a path; only layers no mount uses; bounded; and, like every request, root's
only. A wrong request removes nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from runtime_shim.lazyfs import native, objgc
from runtime_shim.lazyfs.filler import SOCKET
from runtime_shim.lazyfs.objects import ObjectStore
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_tool
from tests.integration.test_lazy_native import _env, node_dir  # noqa: F401  (fixture)
from tests.security.test_lazy_filler_control import (  # noqa: F401  (fixture)
    ATTACKER_PYTHON,
    NOBODY,
    filler_node,
)


def _evict(root: str, **req: object) -> dict:
    reply = native.filler_request(root, {"op": "evict", **req}, 30)
    assert reply is not None
    return reply


def test_an_evict_naming_paths_or_bad_budgets_is_refused_and_removes_nothing(filler_node):
    root, _ping = filler_node
    victim = root / "victim.json"
    victim.write_text("{}")
    layers = root / "objects" / "layers"
    for bad in (["../../victim"], ["/etc/passwd"], ["a" * 63], "x" * 64, [1],
                ["0" * 64] * (objgc.MAX_LAYERS + 1)):
        reply = _evict(str(root), layers=bad)
        assert reply["ok"] is False and "layers" in reply["error"], (bad, reply)
    for bad_budget in (-1, "0", True, 1.5):
        reply = _evict(str(root), layers=[], max_bytes=bad_budget)
        assert reply["ok"] is False and "max_bytes" in reply["error"], reply
    assert victim.read_text() == "{}" and sorted(os.listdir(layers)) == []


def test_an_evict_naming_a_mounted_layer_is_refused_and_its_objects_stay(tmp_path, node_dir):
    data = os.urandom(200_000)
    store, layers = _env(tmp_path, "m", {"data/m": data})
    root = str(node_dir / "node")
    objects = ObjectStore(root)
    with Sandbox.create("m", store=store, node_dir=node_dir, lazy="native") as sb:
        assert sb.exec("cat /data/m >/dev/null").exit_code == 0
        before = sorted(os.listdir(objects.data))
        reply = _evict(root, layers=[layers[1].digest[7:]])
        assert reply["ok"] is False and "is mounted" in reply["error"], reply
        assert sorted(os.listdir(objects.data)) == before
        assert objects.layer_records() != [] and sb.exec("cat /data/m").stdout == data


def test_another_user_cannot_ask_for_an_eviction(filler_node):
    """uid 65534 reaching the socket (a hardlink in an open dir, as a mistake of root's
    would give it) is hung up on: the filler never reads its ``evict``."""
    require_tool(ATTACKER_PYTHON)
    root, _ping = filler_node
    objects = ObjectStore(str(root))
    os.mknod(objects.path("1" * 64), 0o100444)   # an object no layer names
    d = tempfile.mkdtemp(prefix="envbuild-sec-")
    try:
        os.chmod(d, 0o755)
        os.link(root / "objects" / SOCKET, os.path.join(d, "s"))
        os.chmod(root / "objects" / SOCKET, 0o666)   # past the mode: the peer's uid decides
        probe = ("import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
                 "try:\n s.sendall(b'{\"op\": \"evict\", \"layers\": []}\\n')\n"
                 " print('reply', repr(s.recv(100)))\n"
                 "except (BrokenPipeError, ConnectionError):\n print('hung up')\n")
        out = subprocess.run([ATTACKER_PYTHON, "-c", probe, os.path.join(d, "s")],
                             user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                             capture_output=True, text=True, timeout=30,
                             env={"PATH": "/usr/bin:/bin"}).stdout
        assert out.strip() in ("hung up", "reply b''"), out
        assert os.path.exists(objects.path("1" * 64))   # root's evict would remove it
    finally:
        os.chmod(root / "objects" / SOCKET, 0o600)
        shutil.rmtree(d, ignore_errors=True)
    assert _evict(str(root), layers=[])["unlinked"] == 1
