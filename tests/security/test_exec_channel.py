"""Issue 11 items 3 and 10, against real runc and the real agent: the exec channel cannot be
taken over from inside a sandbox, PID 1 cannot be traced or read, every exec has a host-side
deadline, and the host's file access never blocks on a FIFO or opens a device.

The attacks run as root inside a sandbox of ``env/busybox-shell``; where busybox has no tool
for an attack (a unix listener that answers like the agent, ptrace, pidfd_getfd), a small C
program is compiled statically here and written into the sandbox.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation import agent
from runtime_shim.sdk.sandbox import Limits, Sandbox
from tests.bounded import run_bounded
from tests.conftest import require_tool

SECRET = "s3cr3t-token-do-not-leak"

# A fake agent: listens on argv[1], records every byte it is sent to argv[2], answers each
# connection with HELLO, "42 passed" and EXIT 0 -- the forgery of issue 11, item 3.
FORGER_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
static void frame(int c, int t, const void *p, unsigned n) {
    unsigned char h[5] = {t, n >> 24, n >> 16, n >> 8, n};
    write(c, h, 5); write(c, p, n);
}
int main(int argc, char **argv) {
    int l = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strcpy(a.sun_path, argv[1]);
    unlink(argv[1]);
    if (bind(l, (void *)&a, sizeof a) || listen(l, 16)) { perror("listen"); return 1; }
    close(open(argv[3], O_CREAT | O_WRONLY, 0644)); /* ready */
    for (;;) {
        int c = accept(l, 0, 0), log = open(argv[2], O_CREAT | O_WRONLY | O_APPEND, 0644);
        unsigned char buf[65536];
        ssize_t r = read(c, buf, sizeof buf); /* the request comes in one burst */
        if (r > 0) write(log, buf, r);
        close(log);
        frame(c, 0x81, "\0\0\0\1forger", 10);
        frame(c, 0x82, "42 passed\n", 10);
        frame(c, 0x84, "\0\0\0\0\0\0", 6);
        close(c);
    }
}
"""

# Every way into PID 1 that sandbox root had: one line per attempt, "name ok" when the kernel
# allowed it, else "name <errno>".
PROBE_C = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>
static void report(const char *what, int ok) {
    if (ok) printf("%s ok\n", what); else printf("%s %s\n", what, strerrorname_np(errno));
}
static int try_connect(const char *path) {
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strcpy(a.sun_path, path);
    int r = connect(s, (void *)&a, sizeof a);
    close(s);
    return r == 0;
}
int main(void) {
    char buf[256];
    int fd = open("/proc/1/mem", O_RDWR);
    report("mem-rw", fd >= 0);
    fd = open("/proc/1/mem", O_RDONLY);
    report("mem-ro", fd >= 0);
    fd = open("/proc/1/environ", O_RDONLY);
    report("environ", fd >= 0 && read(fd, buf, sizeof buf) >= 0);
    report("fd3-readlink", readlink("/proc/1/fd/3", buf, sizeof buf) >= 0);
    fd = open("/proc/1/fd/3", O_RDONLY);
    report("fd3-open", fd >= 0);
    report("fd3-connect", try_connect("/proc/1/fd/3"));
    report("old-socket-connect", try_connect("/.envbuild/run/agent.sock"));
    long r = ptrace(PTRACE_SEIZE, 1, 0, 0);
    report("ptrace-seize", r == 0);
    int pidfd = syscall(SYS_pidfd_open, 1, 0);
    report("pidfd-getfd", pidfd >= 0 && syscall(SYS_pidfd_getfd, pidfd, 3, 0) >= 0);
    struct iovec local = {buf, 16}, remote = {(void *)0x400000, 16};
    report("process-vm-readv", process_vm_readv(1, &local, 1, &remote, 1, 0) >= 0
           || errno != EPERM); /* EFAULT would mean the permission check passed */
    return 0;
}
"""


def _compile(tmp_path, name: str, source: str):
    require_tool("gcc")
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / name
    proc = subprocess.run(["gcc", "-static", "-O2", "-o", str(out), str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out.read_bytes()


@pytest.fixture
def sandbox(busybox_store):
    store, node = busybox_store
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node) as sb:
        yield sb


def test_a_listener_planted_by_sandbox_root_never_gets_the_next_exec(sandbox, tmp_path):
    sandbox.write_file("/tmp/forger", _compile(tmp_path, "forger", FORGER_C), mode=0o755)
    # everything sandbox root can do to where the socket was (a bind mount from the host)
    plant = sandbox.exec(
        "rm -rf /.envbuild/run/* 2>/dev/null; rm -rf /.envbuild/run 2>/dev/null; "
        "mkdir -p /.envbuild/run && "
        "setsid /tmp/forger /.envbuild/run/agent.sock /tmp/stolen /tmp/ready "
        "</dev/null >/tmp/forger.log 2>&1 & "
        "for i in $(seq 100); do [ -e /tmp/ready ] && exit 0; sleep 0.05; done; exit 1")
    assert plant.exit_code == 0, plant.stderr  # the attack is in place: a listener answers
    for _ in range(3):
        r = sandbox.exec(["sh", "-c", "echo real; exit 3"], env={"SECRET": SECRET})
        assert (r.exit_code, r.stdout) == (3, b"real\n")  # the real result, not "42 passed"
    stolen = sandbox.exec("cat /tmp/stolen 2>/dev/null; true").stdout
    assert SECRET.encode() not in stolen and stolen == b""  # nothing ever connected to it


def test_pid1_cannot_be_traced_read_or_entered(sandbox, tmp_path):
    sandbox.write_file("/tmp/probe", _compile(tmp_path, "probe", PROBE_C), mode=0o755)
    r = sandbox.exec(["/tmp/probe"])
    assert r.exit_code == 0, r.stderr
    got = dict(line.split(" ", 1) for line in r.stdout.decode().splitlines())
    assert set(got) == {"mem-rw", "mem-ro", "environ", "fd3-readlink", "fd3-open",
                        "fd3-connect", "old-socket-connect", "ptrace-seize", "pidfd-getfd",
                        "process-vm-readv"}
    assert [k for k, v in got.items() if v == "ok"] == [], got
    for k in ("mem-rw", "mem-ro", "environ", "fd3-readlink", "ptrace-seize", "pidfd-getfd",
              "process-vm-readv"):
        assert got[k] in ("EACCES", "EPERM"), (k, got[k])
    # non-dumpable holds against root only without CAP_SYS_PTRACE (bit 19) in the sandbox
    status = sandbox.exec("cat /proc/self/status").stdout.decode()
    bounding = int(next(ln for ln in status.splitlines() if ln.startswith("CapBnd:")).split()[1],
                   16)
    assert bounding and not bounding & (1 << 19)
    # busybox's view of the same: no link target of the agent's fds is shown
    ls = sandbox.exec("ls -l /proc/1/fd/ 2>&1; cat /proc/1/environ 2>&1; "
                      "cat /proc/1/mem 2>&1; true")
    assert b"socket:" not in ls.stdout and b"PATH=" not in ls.stdout, ls.stdout
    assert b"denied" in ls.stdout or b"not permitted" in ls.stdout


def test_commands_inherit_no_agent_fd_and_see_no_socket(sandbox):
    r = sandbox.exec("ls /proc/self/fd; ls -a /.envbuild; cat /proc/net/unix")
    fds = r.stdout.decode().split("\n.\n")[0].split()
    assert sorted(fds)[:3] == ["0", "1", "2"] and len(fds) <= 4, r.stdout  # 3 = ls's own dir
    assert b"run" not in r.stdout.split(b"\n.")[0]
    assert b"agent.sock" not in r.stdout


def test_a_process_in_the_sandbox_pid_namespace_is_refused(sandbox):
    """Even a process that *can* reach the socket (the host's python entered into the
    sandbox's pid namespace only) gets nothing: the agent checks SO_PEERCRED."""
    require_tool("nsenter")
    code = ("import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            f"s.connect({str(sandbox.paths.root / 'agent.sock')!r})\n"
            "s.settimeout(5)\n"
            "try:\n"
            "    s.sendall(bytes([1, 0, 0, 0, 4, 0, 0, 0, 1]))\n"
            "    sys.stdout.write(repr(s.recv(100)))\n"
            "except (BrokenPipeError, ConnectionResetError):\n"
            "    sys.stdout.write('refused')\n")
    out = subprocess.run(["nsenter", "-t", str(sandbox.host_pid), "-p", "--",
                          sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and out.stdout in ("b''", "refused"), out
    assert sandbox.exec(["true"]).ok


def test_exec_without_timeout_still_ends_at_the_sandbox_deadline(busybox_store):
    store, node = busybox_store
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node,
                        limits=Limits(exec_timeout=1.0)) as sb:
        started = time.monotonic()
        r = sb.exec("sleep 60; echo never", timeout=None)
        assert r.timed_out and r.exit_code == 124 and r.stdout == b""
        assert time.monotonic() - started < 1.0 + agent.HOST_TIMEOUT_SLACK + 2
        assert sb.exec(["true"]).ok  # the sandbox lives on


def test_a_never_answering_agent_does_not_hang_the_host(tmp_path):
    """A listener that accepts and says nothing (a stuck or hostile agent): ``timeout=None``
    returns at the deadline."""
    path = tmp_path / "agent.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen()
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    started = time.monotonic()
    with pytest.raises(RuntimeShimError, match="did not answer"):
        agent.run(lambda: agent.connect_agent(str(path)),
                  agent.ExecRequest(argv=("true",), timeout=None), 1 << 20, deadline=0.5)
    assert time.monotonic() - started < 0.5 + agent.HOST_TIMEOUT_SLACK + 1
    listener.close()


# ---- item 10: read_file / write_file on FIFOs and devices ----------------------------------




def test_read_and_write_file_refuse_fifos_and_devices_without_blocking(sandbox):
    assert sandbox.exec("mkfifo /tmp/fifo && ln -s /tmp/fifo /tmp/link-to-fifo").exit_code == 0
    for path in ("/tmp/fifo", "/tmp/link-to-fifo", "/dev/null", "/dev/zero", "/tmp"):
        with pytest.raises(RuntimeShimError, match="not a regular file"):
            run_bounded(lambda p=path: sandbox.read_file(p))
        with pytest.raises(RuntimeShimError, match="not a regular file"):
            run_bounded(lambda p=path: sandbox.write_file(p, b"x"))
    # the FIFO was never opened: a reader in the sandbox would have seen our "x"
    r = sandbox.exec("timeout 1 cat /tmp/fifo; ls -l /tmp/fifo")
    assert r.stdout.startswith(b"p")
    # regular files still work, through a symlink too, and new files are created
    sandbox.exec("echo hi > /tmp/f && ln -s /tmp/f /tmp/link")
    assert run_bounded(lambda: sandbox.read_file("/tmp/link")) == b"hi\n"
    run_bounded(lambda: sandbox.write_file("/tmp/link", b"new"))
    run_bounded(lambda: sandbox.write_file("/tmp/d/new.txt", b"made"))
    assert sandbox.exec("cat /tmp/f /tmp/d/new.txt").stdout == b"newmade"
