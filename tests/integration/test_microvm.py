"""Sandboxes as QEMU microVMs (TCG here: /dev/kvm refuses Debian's kernels, MACHINE-NOTES.md).

Each boot costs seconds under TCG, so one busybox VM is shared by most checks (module-scoped)
and the rest boot once each: close, kill -9 of the host process, the Python env. Missing
QEMU, kernel or mkfs tools fail the tests with the install hint; nothing is skipped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.sdk.sandbox import Limits, Sandbox, gc_sandboxes
from tests.conftest import REPO, require_root, require_tool
from tests.integration.conftest import build_busybox_env, python_example_store

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _require_vm_tools() -> None:
    require_root()
    for tool in ("qemu-system-x86_64", "mkfs.erofs", "mkfs.ext4", "busybox", "gcc"):
        require_tool(tool)
    from runtime_shim.backends.vm.kernel import find_kernel

    try:
        find_kernel(os.environ)
    except RuntimeShimError as e:
        pytest.fail(f"{e.message}; {e.hint}", pytrace=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A store with the busybox env built and locked, and a node dir for sandboxes."""
    _require_vm_tools()
    return build_busybox_env(tmp_path_factory.mktemp("microvm"))


@pytest.fixture(scope="module")
def vm(built):
    store, node = built
    sb = Sandbox.create("busybox-shell", store=store, node_dir=node, backend="microvm",
                        limits=Limits(memory_bytes=384 << 20))
    yield sb
    sb.close()


def _qemu_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "qemu-system-x86_64"], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return True  # exited; its parent has not reaped it yet
        time.sleep(0.05)
    return False


def test_exec_output_exit_codes_and_lock_config(vm):
    r = vm.exec("echo out; echo err >&2; pwd; echo $KV_FILE; hostname; exit 3")
    assert r.exit_code == 3
    assert r.stdout == b"out\n/workspace\n/workspace/.kv\nsandbox\n"
    assert r.stderr == b"err\n"
    assert vm.exec(["shtest", "/workspace/tests"]).exit_code == 0
    assert vm.exec("cat", stdin=b"piped").stdout == b"piped"
    assert vm.exec("echo $X; pwd", env={"X": "y"}, cwd="/tmp").stdout == b"y\n/tmp\n"
    assert vm.exec(["id", "-u"], user="1000:1000").stdout == b"1000\n"
    r = vm.exec(["no-such-command"])
    assert r.exit_code == 127 and b"no-such-command" in r.stderr


def test_it_is_a_vm_with_its_own_kernel_and_the_memory_limit(vm):
    assert vm.exec("uname -r").stdout.strip().endswith(b"cloud-amd64")
    mem_kb = int(vm.exec("awk '/MemTotal/ {print $2}' /proc/meminfo").stdout)
    assert 250_000 < mem_kb <= 384 * 1024
    mounts = vm.exec("cat /proc/mounts").stdout.decode()
    assert "overlay / overlay" in mounts and "upperdir=/rw/upper" in mounts


def test_written_file_is_readable_and_writes_stay_in_upper(vm):
    vm.write_file("/workspace/notes/a.txt", "hello\n", mode=0o600)
    assert vm.read_file("/workspace/notes/a.txt") == b"hello\n"
    assert vm.exec("stat -c %a /workspace/notes/a.txt").stdout == b"600\n"
    vm.exec("printf 'bin\\0ary' > /tmp/b; echo made > /workspace/made-by-exec")
    assert vm.read_file("/tmp/b") == b"bin\0ary"
    assert vm.read_file("workspace/made-by-exec") == b"made\n"
    big = os.urandom(3 << 20)
    vm.write_file("/big", big)
    assert vm.read_file("/big") == big
    with pytest.raises(RuntimeShimError, match="No such file"):
        vm.read_file("/nope")
    with pytest.raises(RuntimeShimError, match="not a regular file"):
        vm.read_file("/workspace")


def test_timeout_kills_the_command_not_the_vm(vm):
    started = time.monotonic()
    r = vm.exec("sleep 30", timeout=1)
    assert r.timed_out and 0.9 < time.monotonic() - started < 10
    assert vm.exec("echo alive").stdout == b"alive\n"


def test_concurrent_execs_share_the_serial_line(vm):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: vm.exec(f"head -c {i * 100_000} /dev/zero | wc -c"),
                                range(1, 9)))
    assert [int(r.stdout) for r in results] == [i * 100_000 for i in range(1, 9)]
    assert len(vm.exec("head -c 5000000 /dev/zero").stdout) == 5_000_000


def test_a_pty_in_the_guest(vm):
    """A PTY (agent protocol 2) over the serial line: the guest's agent opens the terminal;
    resize and the exit code come back as in a container."""
    out: list[bytes] = []
    proc = vm.start("sh", pty=(20, 60), on_stdout=out.append, env={"PS1": "$ "})
    proc.write_stdin("[ -t 0 ] && tty; stty size\r")
    deadline = time.monotonic() + 60
    while b"20 60" not in b"".join(out) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.resize(30, 90)
    proc.write_stdin("stty size; exit 3\r")
    result = proc.wait(120)
    text = b"".join(out)
    assert result.exit_code == 3 and b"/dev/pts/" in text, text
    assert b"\r\n20 60\r\n" in text and b"\r\n30 90\r\n" in text, text


def test_no_network_interface_but_lo(vm):
    links = vm.exec("ls /sys/class/net").stdout.split()
    assert links == [b"lo"]


def test_erofs_images_keep_overlay_whiteouts_and_opaque_dirs(tmp_path):
    """The layer dir → EROFS step keeps both kinds of overlay whiteout (a 0/0 char device and
    the ``trusted.overlay.opaque`` xattr), so the guest's overlayfs honours deletions."""
    _require_vm_tools()
    from runtime_shim.backends.vm.erofs import ensure_erofs

    layer = tmp_path / "layer"
    (layer / "opaque").mkdir(parents=True)
    (layer / "opaque" / "kept").write_text("k")
    os.setxattr(layer / "opaque", "trusted.overlay.opaque", b"y")
    os.mknod(layer / "deleted", 0o600 | 0o020000, os.makedev(0, 0))
    image = ensure_erofs(tmp_path / "node", "sha256:" + "ab" * 32, layer)
    assert image == tmp_path / "node" / "erofs" / ("ab" * 32 + ".erofs")
    assert ensure_erofs(tmp_path / "node", "sha256:" + "ab" * 32, layer) == image  # cached
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "erofs", "-o", "ro,loop", str(image), str(mnt)], check=True)
    try:
        st = os.lstat(mnt / "deleted")
        assert (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0
        assert os.getxattr(mnt / "opaque", "trusted.overlay.opaque") == b"y"
        assert (mnt / "opaque" / "kept").read_text() == "k"
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_close_leaves_no_process_mount_or_file(built):
    store, node = built
    sb = Sandbox.create("busybox-shell", store=store, node_dir=node, backend="microvm",
                        limits=Limits(memory_bytes=256 << 20))
    pid = sb.host_pid
    root = sb.paths.root
    assert sb.exec("true").ok
    sb.close()
    sb.close()  # idempotent
    assert _gone(pid, 5)
    assert not root.exists()
    assert mounted_targets_under(str(node)) == []
    with pytest.raises(RuntimeShimError, match="closed"):
        sb.exec("true")
    # the shared, per-layer images stay for the next VM
    assert any((node / "node" / "erofs").glob("*.erofs"))


def test_killing_the_host_process_kills_qemu(built, tmp_path):
    store, node = built
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time, threading
        from envbuild.store import LocalStore
        from runtime_shim.sdk.sandbox import Limits, Sandbox
        # created from a short-lived thread: QEMU must outlive the thread, not the process
        box = []
        t = threading.Thread(target=lambda: box.append(Sandbox.create(
            "busybox-shell", store=LocalStore({str(node.parent / "store")!r}), node_dir={str(node)!r},
            backend="microvm", limits=Limits(memory_bytes=256 << 20))))
        t.start(); t.join()
        sb = box[0]
        assert sb.exec("true").ok
        from runtime_shim.sdk import exitwatch
        exitwatch.stop()  # a crash its watcher dies in too: gc removes what is left
        print(sb.host_pid, flush=True)
        time.sleep(600)
    """))
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, cwd=REPO,
                             text=True)
    try:
        line = child.stdout.readline()
        assert line.strip(), "the child did not start a VM"
        qemu_pid = int(line)
        assert qemu_pid in _qemu_pids()
        time.sleep(0.5)
        assert child.poll() is None  # the VM survived its creating thread
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert _gone(qemu_pid, 5), "QEMU outlived the process that started it"
    finally:
        if child.poll() is None:
            child.kill()
    removed = gc_sandboxes(node)  # the dead process's sandbox dir is found and removed
    assert len(removed) == 1 and not (node / "sandboxes" / removed[0]).exists()


def test_python_env_boots_and_runs_its_tests(built, request):
    _, node = built
    store = python_example_store(request)
    with Sandbox.create("py-textstats", store=store, node_dir=node, backend="microvm",
                        limits=Limits(memory_bytes=768 << 20)) as sb:
        r = sb.exec(["python3", "-c", "import sys, textstats; print(sys.version_info[:2])"])
        assert r.exit_code == 0, r.stderr
        assert r.stdout == b"(3, 11)\n"
        r = sb.exec(["pytest", "-q", "-p", "no:cacheprovider"], timeout=300)
        assert r.exit_code == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert sb.exec(["rg", "--version"]).ok
