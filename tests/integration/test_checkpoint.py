"""Checkpoints with memory of container sandboxes, against real runc and CRIU.

CRIU must work on this kernel: Debian 12's 3.17.1 does not on Linux >= 6.13 (``[vvar_vclock]``,
see ``runtime_shim.criu``); ``$ENVBUILD_CRIU`` names a CRIU >= 4.1. Without one the tests
that dump fail loudly (``require_criu``); the probe test pins the reason Debian's gives.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from envbuild.errors import BackendUnavailable, CheckpointRefused, LockNotFound
from envbuild.store import get_json
from runtime_shim import Sandbox, criu
from runtime_shim.checkpoint import ANNOTATION_IMAGE, ANNOTATION_RECORD
from runtime_shim.locks import resolve
from tests.conftest import require_root

pytestmark = pytest.mark.integration

COUNTER = ("cd /workspace && (i=0; while true; do i=$((i+1)); echo $i > /workspace/count; "
           "sleep 0.1; done) > /dev/null 2>&1 &")


def require_criu() -> str:
    require_root()
    try:
        return criu.criu_binary()
    except BackendUnavailable as e:
        pytest.fail(f"no working CRIU: {e.message} — {e.hint}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from tests.integration.conftest import build_busybox_env

    return build_busybox_env(tmp_path_factory.mktemp("ckpt-env"))


def _count(sb) -> int:
    return int(sb.exec("cat /workspace/count").stdout.decode().strip() or 0)


def test_debian_criu_3_17_names_why_it_cannot_run_here(monkeypatch):
    """The probe reports CRIU's own error line, not a traceback (Debian's CRIU on >= 6.13)."""
    require_root()
    if not os.path.exists("/usr/sbin/criu"):
        pytest.fail("Debian's criu is not installed (scripts/setup.sh)")
    monkeypatch.setenv("ENVBUILD_CRIU", "/usr/sbin/criu")
    monkeypatch.setattr(criu, "_PROBED", {})
    try:
        criu.criu_binary()
    except BackendUnavailable as e:
        assert "vdso" in e.message or "criu" in e.message
        assert "\n" not in e.message
    else:  # a Debian CRIU that works here: then it must pass check
        assert os.uname().release < "6.13"


def test_checkpoint_stores_one_artifact_and_leaves_the_sandbox_running(built, tmp_path):
    require_criu()
    store, node = built
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node) as sb:
        sb.exec(COUNTER)
        sb.write_file("/workspace/note.txt", "before the checkpoint")
        time.sleep(0.5)
        result = sb.checkpoint("ckpt/counter", leave_running=True)
        before = _count(sb)
        time.sleep(0.5)
        assert _count(sb) > before  # leave_running: the job runs on
        assert not (sb.paths.root / "checkpoint-image").exists()  # no image left on the node
    lock = resolve(store, "ckpt/counter")
    assert lock.digest == result.lock
    notes = lock.manifest["annotations"]
    assert notes[ANNOTATION_IMAGE] == result.image and notes[ANNOTATION_RECORD] == result.record
    assert lock.layers[-1].digest == result.layer  # the files: a snapshot layer on top
    record = get_json(store, result.record)
    comms = [p["comm"] for p in record["backend_record"]["processes"]]
    assert comms[0] == "envbuild-agent" and "sh" in comms  # the tree envbuild saw
    assert ["/", "overlay"] in record["backend_record"]["mounts"]
    assert result.image_bytes > 0 and result.image_stored > 0 and result.dump_seconds > 0
    assert store.stat(result.image).size == result.image_stored


def test_checkpoint_without_leave_running_closes_the_sandbox(built):
    require_criu()
    store, node = built
    sb = Sandbox.create("env/busybox-shell", store=store, node_dir=node)
    try:
        sb.exec("sleep 1000 > /dev/null 2>&1 &")
        sb.checkpoint("ckpt/stopped", leave_running=False)
        assert sb.closed and not sb.paths.root.exists()
    finally:
        sb.close()


def test_a_process_criu_cannot_dump_is_named_and_the_sandbox_runs_on(built):
    """An exec in flight: the agent holds a stream socket whose peer is the host, which CRIU
    cannot dump. The error names the process and CRIU's reason; the sandbox runs on."""
    import threading

    require_criu()
    store, node = built
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node) as sb:
        running = threading.Thread(target=sb.exec, args=("sleep 3",))
        running.start()
        time.sleep(0.5)
        with pytest.raises(CheckpointRefused) as err:
            sb.checkpoint("ckpt/bad", leave_running=True)
        running.join()
        assert "\n" not in err.value.message and err.value.message.startswith("checkpoint ")
        assert "unix" in err.value.message or "socket" in err.value.message
        assert sb.exec("echo alive").stdout == b"alive\n"
    with pytest.raises(LockNotFound):
        resolve(store, "ckpt/bad")  # nothing published


def test_restore_refuses_an_image_that_is_not_the_recorded_one(built, tmp_path):
    """A checkpoint lock whose image annotation points at another blob is refused with one
    line, before anything is made: the node dir keeps no sandbox."""
    require_criu()
    import copy

    from envbuild.oci import MEDIA_TYPE_MANIFEST
    from envbuild.store import put_json

    store, node = built
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node) as sb:
        first = sb.checkpoint(None, leave_running=True)
        sb.exec("echo more > /workspace/more")
        second = sb.checkpoint(None, leave_running=True)
    lock = resolve(store, first.lock)
    manifest = copy.deepcopy(dict(lock.manifest))
    manifest["annotations"][ANNOTATION_IMAGE] = second.image  # swapped memory image
    forged = put_json(store, manifest, media_type=MEDIA_TYPE_MANIFEST).digest
    other = tmp_path / "node2"
    with pytest.raises(CheckpointRefused) as err:
        Sandbox.restore(forged, store=store, node_dir=other)
    assert "\n" not in err.value.message
    assert not (other / "sandboxes").exists() or not any((other / "sandboxes").iterdir())


def test_check_image_refuses_a_changed_file(built, tmp_path):
    """The image's files are checked against envbuild's record before CRIU sees them."""
    require_criu()
    from runtime_shim.backend import CheckpointImage
    from runtime_shim.checkpoint import read_record, unpack_image

    store, node = built
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node) as sb:
        made = sb.checkpoint(None, leave_running=True)
    lock = resolve(store, made.lock)
    record = read_record(store, lock)
    image = unpack_image(store, lock, record, tmp_path / "img")
    criu.check_image(image, None)  # as dumped: accepted
    pstree = tmp_path / "img" / "pstree.img"
    data = bytearray(pstree.read_bytes())
    data[-1] ^= 1
    pstree.write_bytes(bytes(data))
    with pytest.raises(CheckpointRefused, match="pstree.img does not match"):
        criu.check_image(image, None)
    (tmp_path / "img" / "extra.img").write_bytes(b"x")
    with pytest.raises(CheckpointRefused, match="files differ"):
        criu.check_image(CheckpointImage("criu", image.dir, image.record), None)
    shutil.rmtree(tmp_path / "img")
