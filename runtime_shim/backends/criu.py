"""Checkpoints with memory of container sandboxes: CRIU, driven by ``runc checkpoint`` /
``runc restore`` (``backend.Checkpointable`` / ``backend.Restorable`` of the container backend).

**What is dumped.** Every process of the sandbox (its PID 1 is the exec agent): memory, open
files, cwd, seccomp filter, namespaces' contents (uts, ipc, the mounts of its mount namespace:
``/dev`` tmpfs contents included). Not dumped: the root filesystem (the SDK packs the upper dir
as a snapshot layer under the hostile-content policy, ``Sandbox.checkpoint``), bind mounts
(runc marks them external: ``/tmp``, the agent binary, ``resolv.conf`` come from the restoring
sandbox), the network namespace (external: the restored sandbox joins its own new one, so a
restore never carries a network the fresh sandbox would not have).

**Three things envbuild hands CRIU itself** (options in ``<sandbox dir>/criu.conf``, which runc
passes to CRIU through the ``org.criu.config`` annotation every container gets):

- the agent's stderr (``start.log`` on the sandbox's disk, a file of no mount of the sandbox) is
  ``external file[MNT:INO]`` on dump and ``inherit-fd`` of the new sandbox's log on restore;
- the agent's listening socket (bound in the host's sandbox dir) is ``inherit-fd`` of the new
  sandbox's socket on restore. CRIU finds a socket only in the network namespace of the process
  it dumps, so a sandbox created ``checkpointable=True`` joins a namespace envbuild made
  (``own_netns``: only ``lo``, like runc's own) and the socket is made inside it
  (``in_netns``). The sandbox then sees the socket in ``/proc/net/unix`` but still cannot reach
  it (no mount shows its path), which is why it is not the default;
- the network namespace: runc passes it by path (``extRootNetNS``).

**The record.** ``checkpoint`` returns a ``CheckpointImage`` whose ``record`` is envbuild's own
view, read from ``/proc`` before the dump, never from the image: the process tree (pid and
parent in the sandbox's pid namespace, command name), the mount points with their types, the
keys of the external files, the CRIU version, and every image file's sha256 and size.
``check_image`` refuses (``CheckpointRefused``, one line) an image whose files are not exactly
those: a tampered process tree or mount table is a changed ``pstree.img`` / ``mountpoints-*.img``
and never reaches CRIU.

After a restore, the mounts of the restored sandbox are compared with the record too
(``check_restored``); a mismatch closes it.

**CRIU on this kernel.** Debian 12's ``criu`` 3.17.1 cannot run on Linux 6.13 and later: the
kernel split the vDSO data into ``[vvar]`` + ``[vvar_vclock]`` and CRIU 3.17 fails before doing
anything (``criu check``: ``Error (criu/vdso.c:381): vdso: Unexpected rt vDSO area bounds``);
CRIU 4.1 handles it, but dumps ``SO_PASSCRED`` of every socket, which Linux 6.16+ refuses on
inet sockets (``sockets: Can't get 1:16 opt: Operation not supported``): a process with a TCP
socket needs CRIU 4.2 (``scripts/build-criu.sh`` builds it from Debian's source package).
``criu_binary`` takes ``$ENVBUILD_CRIU``, else the first ``criu`` on ``PATH`` /
``/usr/local/sbin`` / ``/usr/sbin`` that passes ``criu check``, and reports CRIU's failing
lines when none does. Two more things found by trying: CRIU does not set the status flags of an
inherited fd (the new agent socket is made non-blocking here, as the agent made its own), and
CRIU < 4.2 reads an RPC config twice (``_ConfigFeeder``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from envbuild.errors import BackendUnavailable, CheckpointRefused, RuntimeShimError
from envbuild.libc import LIBC
from runtime_shim.backends import criu_rlimits
from runtime_shim.backends.base import CheckpointImage

if TYPE_CHECKING:
    from runtime_shim.backends.base import CreateRequest
    from runtime_shim.isolation.runc import OciRuntime
    from runtime_shim.node.layout import SandboxPaths
    from runtime_shim.node.locks import ResolvedLock


class ContainerSandbox(Protocol):
    """What a checkpoint reads of a running container sandbox
    (``runtime_shim.backends.container.ContainerSandbox``, which imports this module: a
    protocol here, not an import back)."""

    id: str
    init_pid: int
    lock: ResolvedLock
    paths: SandboxPaths
    runtime: OciRuntime

RECORD_VERSION = 1
IMAGE_KIND = "criu"
CLONE_NEWNET = 0x40000000
#: The sandbox's own empty network namespace (without ``network=``), bind-mounted here.
OWN_NETNS = "netns.own"
#: CRIU's options for the next dump or restore of a sandbox (``org.criu.config``).
CONFIG_FILE = "criu.conf"
#: Where CRIU writes its log and scratch (in the sandbox dir, outside the image).
WORK_DIR = "criu-work"
#: The fds of ``runc restore`` (and so of ``criu swrk``) that carry the new agent socket and
#: log (fds 0-2 are runc's own stdio, 3-7 runc's and CRIU's).
INHERIT_SOCKET_FD = 9
INHERIT_LOG_FD = 8
#: Bounds on an image read back from a store (hostile input).
MAX_IMAGE_FILES = 4096
MAX_RECORD_PROCESSES = 4096


def own_netns(directory: Path) -> str:
    """An empty network namespace bound on ``<directory>/netns.own`` (only ``lo``, up, as in
    runc's own new namespace): the sandbox joins it by path, so the agent's socket can be
    made inside it (``in_netns``) where CRIU's socket diagnostics find it. The bind mount goes
    with the sandbox dir (``remove_sandbox_dir`` unmounts everything below it)."""
    ns = directory / OWN_NETNS
    ns.touch(mode=0o600)
    # lo up, as runc does in a namespace it makes (loopback works, nothing else exists)
    done = subprocess.run(["unshare", f"--net={ns}", "--", "ip", "link", "set", "lo", "up"],
                          capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeShimError("create the sandbox's network namespace: "
                               f"{done.stderr.decode(errors='replace').strip()}")
    return str(ns)


def in_netns(ns_path: str | None, make: Callable[[], socket.socket]) -> socket.socket:
    """``make()`` run on a thread that joined the network namespace ``ns_path``: a socket made
    there belongs to that namespace (the namespace of a thread goes with the thread); ``None``:
    ``make()`` here."""
    if ns_path is None:
        return make()
    out: list[socket.socket] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if LIBC.setns(fd, CLONE_NEWNET) != 0:
                    e = ctypes.get_errno()
                    raise RuntimeShimError(f"join the sandbox's network namespace: "
                                           f"{os.strerror(e)}")
            finally:
                os.close(fd)
            out.append(make())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            err.append(e)

    t = threading.Thread(target=run, name="envbuild-netns")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


# ------------------------------------------------------------------------------ the binary

_PROBED: dict[str, str] = {}


def _candidates() -> list[str]:
    env = os.environ.get("ENVBUILD_CRIU")
    if env:
        return [env]
    found = []
    for where in (None, "/usr/local/sbin:/usr/local/bin", "/usr/sbin:/sbin"):
        path = shutil.which("criu", path=where)
        if path and path not in found:
            found.append(path)
    return found


def criu_binary() -> str:
    """A CRIU that works on this kernel (``criu check`` passes), probed once per process, or
    ``BackendUnavailable`` with CRIU's own error lines."""
    if "ok" in _PROBED:
        return _PROBED["ok"]
    tried = []
    for path in _candidates():
        try:
            done = subprocess.run([path, "check"], capture_output=True, text=True, timeout=60,
                                  check=False)
        except OSError as e:
            tried.append(f"{path}: {e.strerror}")
            continue
        if done.returncode == 0:
            _PROBED["ok"] = path
            return path
        errors = [ln.strip() for ln in (done.stderr + done.stdout).splitlines()
                  if "Error" in ln][:3]
        tried.append(f"{path} ({_version(path)}): " + ("; ".join(errors) or "check failed"))
    if not tried:
        raise BackendUnavailable("checkpoint: criu is not installed",
                                 hint="apt-get install criu, or set ENVBUILD_CRIU "
                                      "(scripts/setup.sh)")
    raise BackendUnavailable(
        "checkpoint: CRIU cannot run on this kernel: " + " | ".join(tried),
        hint="Linux >= 6.13 needs CRIU >= 4.1 (the [vvar_vclock] mapping); set ENVBUILD_CRIU "
             "to one (scripts/setup.sh builds it when Debian's is too old)")


def _version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10,
                             check=False).stdout
    except OSError:
        return "?"
    m = re.search(r"Version:\s*(\S+)", out)
    return m.group(1) if m else "?"


# ------------------------------------------------------------------------------ the record


def _status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def process_tree(init_pid: int) -> list[dict[str, Any]]:
    """The sandbox's processes as ``/proc`` shows them from the host: pid and parent in the
    sandbox's pid namespace, command name; parents first."""
    found = _processes(init_pid)
    by_host = {p["host_pid"]: p["pid"] for p in found}
    return [{"pid": p["pid"], "ppid": by_host.get(p["ppid_host"], 0), "comm": p["comm"]}
            for p in found]


def _processes(init_pid: int) -> list[dict[str, Any]]:
    """``process_tree``'s walk, each process with its ``host_pid`` and ``ppid_host``."""
    found: list[dict[str, Any]] = []
    todo = [init_pid]
    while todo:
        pid = todo.pop(0)
        try:
            st = _status(pid)
            kids = []
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    kids += [int(k) for k in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited while we looked (the sandbox is frozen: only at the edge)
        nspid = int(st["NSpid"].split()[-1])
        found.append({"pid": nspid, "host_pid": pid, "comm": st["Name"],
                      "ppid_host": int(st["PPid"])})
        todo += kids
        if len(found) > MAX_RECORD_PROCESSES:
            raise CheckpointRefused(f"checkpoint: more than {MAX_RECORD_PROCESSES} processes")
    return found


def refuse_named_pipes(sandbox_id: str, init_pid: int) -> None:
    """``CheckpointRefused`` naming the first process of the sandbox that holds a named pipe
    (FIFO) open: CRIU dumps it, but a restore must reopen it by path and the FIFO is not there
    (``/tmp`` is the new sandbox's, and the snapshot policy drops FIFOs), so the checkpoint
    would be published and never restore. Anonymous pipes are dumped whole and are fine."""
    for p in _processes(init_pid):
        fd_dir = f"/proc/{p['host_pid']}/fd"
        with contextlib.suppress(OSError):  # it exited meanwhile
            for fd in sorted(os.listdir(fd_dir), key=int):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"{fd_dir}/{fd}")
                    if link.startswith(("pipe:", "socket:", "anon_inode:")):
                        continue
                    if stat.S_ISFIFO(os.stat(f"{fd_dir}/{fd}").st_mode):  # no open: no block
                        raise CheckpointRefused(
                            f"checkpoint {sandbox_id} (process {p['pid']} {p['comm']}): it "
                            f"holds the named pipe {link!r} open (fd {fd}), which a restore "
                            "cannot reopen",
                            hint="close it before the checkpoint (an anonymous pipe is fine); "
                                 "the sandbox runs on")


def mount_table(init_pid: int) -> list[list[str]]:
    """``[mount point, fs type]`` of every mount of the sandbox's mount namespace."""
    rows = []
    with open(f"/proc/{init_pid}/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            rows.append([left.split()[4], right.split()[0]])
    return rows


def _file_key(pid: int, fd: int) -> str:
    """CRIU's id of an external regular file: ``file[MNT_ID:INODE]`` in hex."""
    st = os.stat(f"/proc/{pid}/fd/{fd}")
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        mnt = next(int(ln.split()[1]) for ln in f if ln.startswith("mnt_id:"))
    return f"file[{mnt:x}:{st.st_ino:x}]"


def _socket_key(pid: int, fd: int) -> str:
    link = os.readlink(f"/proc/{pid}/fd/{fd}")
    if not link.startswith("socket:["):
        raise CheckpointRefused(f"checkpoint: the agent's fd {fd} is not a socket ({link})")
    return link


def hash_files(directory: Path) -> dict[str, dict[str, Any]]:
    """``{name: {sha256, size}}`` of the regular files in ``directory`` (flat; anything else
    refuses the image)."""
    files: dict[str, dict[str, Any]] = {}
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in sorted(os.listdir(dir_fd)):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointRefused(f"memory image: {name} is not a regular file",
                                        hint="the image was tampered with; checkpoint again")
            if len(files) >= MAX_IMAGE_FILES:
                raise CheckpointRefused(f"memory image: more than {MAX_IMAGE_FILES} files")
            h = hashlib.sha256()
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            with os.fdopen(fd, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            files[name] = {"sha256": h.hexdigest(), "size": st.st_size}
    finally:
        os.close(dir_fd)
    return files


# ------------------------------------------------------------------------------ checkpoint


def _errors(log: Path) -> list[str]:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    # "(00.012345) Error (criu/files-reg.c:1790): Can't lookup mount=63 for fd=2 ..."
    return [re.sub(r"^.*?Error \([^)]*\):\s*", "", ln).strip() for ln in text.splitlines()
            if "Error (" in ln]


def _refusal(what: str, errors: list[str], tree: list[dict[str, Any]],
             fallback: str) -> CheckpointRefused:
    """One line naming the process CRIU failed on (by its pid in the sandbox) and why."""
    noise = ("rlimit: Can't setup RLIMIT_NOFILE",)  # root without CAP_SYS_RESOURCE: harmless
    real = [e for e in errors if not e.startswith(noise)] or [fallback]
    why = real[0]
    for e in real:
        m = re.search(r"\(pid: (\d+)\)", e)
        if m:
            break
    else:
        m = None
    who = ""
    if m:
        who = f" (host pid {m.group(1)})"
    comms = {str(p["pid"]): p["comm"] for p in tree}
    m2 = re.search(r"\bpid[ =:]+(\d+)", why)
    if m2 and m2.group(1) in comms:
        who = f" (process {m2.group(1)} {comms[m2.group(1)]})"
    return CheckpointRefused(f"{what}{who}: {why}", context="\n".join(real[:10]),
                             hint="see criu-work/dump.log in the sandbox dir; the sandbox runs on")


def _sessions(pid: int) -> list[str]:
    """The agent's connections from the host (sockets besides its listener, fd 3)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if int(fd) > 3 and os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                found.append(fd)
    return found


def _settle(sb: ContainerSandbox, wait: float = 2.0) -> None:
    """Let the agent close the connections the host already closed (the last HELLO or exec:
    it sees their EOF on its next poll), resuming it briefly if needed: CRIU cannot dump a
    connection to the host. One still open after ``wait`` (an exec in flight) stays, and the
    dump names it."""
    if not _sessions(sb.init_pid):
        return
    subprocess.run(sb.runtime.command("resume", sb.id), capture_output=True, check=False)
    try:
        deadline = time.monotonic() + wait
        while _sessions(sb.init_pid) and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        subprocess.run(sb.runtime.command("pause", sb.id), capture_output=True, check=False)


def checkpoint(sb: ContainerSandbox, dest: Path, *, leave_running: bool) -> CheckpointImage:
    """Dump every process of ``sb`` into ``dest`` (``runc checkpoint``; see the module
    docstring). ``sb`` is paused (``quiesce``): the record is read while nothing moves."""
    binary = criu_binary()
    started = time.monotonic()
    pid = sb.init_pid
    _settle(sb)
    tree = process_tree(pid)
    refuse_named_pipes(sb.id, pid)
    record: dict[str, Any] = {
        "version": RECORD_VERSION, "kind": IMAGE_KIND, "criu": _version(binary),
        "lock": sb.lock.digest, "processes": tree, "mounts": mount_table(pid),
        "agent_log": _file_key(pid, 2), "agent_socket": _socket_key(pid, 3)}
    work = sb.paths.root / WORK_DIR
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    conf = sb.paths.root / CONFIG_FILE
    conf.unlink(missing_ok=True)  # a restored sandbox's was a FIFO (_ConfigFeeder)
    conf.write_text(f"external {record['agent_log']}\n")
    dest.mkdir(parents=True, exist_ok=True)
    argv = sb.runtime.command("--criu", binary, "checkpoint", "--image-path", str(dest),
                              "--work-path", str(work),
                              *(["--leave-running"] if leave_running else []), sb.id)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        errors = _errors(work / "dump.log")
        raise criu_rlimits.refusal(f"checkpoint {sb.id}", errors, lambda: _processes(pid)) \
            or _refusal(f"checkpoint {sb.id}", errors, tree,
                        done.stderr.strip()[-300:] or f"runc exited {done.returncode}")
    record["files"] = hash_files(dest)
    size = sum(f["size"] for f in record["files"].values())
    return CheckpointImage(kind=IMAGE_KIND, dir=dest, record=record, bytes=size,
                           seconds=time.monotonic() - started)


# ------------------------------------------------------------------------------ restore


def check_record(record: Mapping[str, Any]) -> None:
    """The record's own shape (it came from a store): version, kind, bounded lists."""
    if not isinstance(record, Mapping) or record.get("version") != RECORD_VERSION \
            or record.get("kind") != IMAGE_KIND:
        raise CheckpointRefused("memory image: its record is not a CRIU record of version "
                                f"{RECORD_VERSION}", hint="checkpoint again with this envbuild")
    files, procs = record.get("files"), record.get("processes")
    if not isinstance(files, Mapping) or not isinstance(procs, list) \
            or len(files) > MAX_IMAGE_FILES or len(procs) > MAX_RECORD_PROCESSES:
        raise CheckpointRefused("memory image: malformed record")
    for key in ("agent_log", "agent_socket"):
        if not re.fullmatch(r"file\[[0-9a-f]+:[0-9a-f]+\]|socket:\[\d+\]",
                            str(record.get(key, ""))):
            raise CheckpointRefused(f"memory image: malformed record ({key})")


def check_image(image: CheckpointImage, req: CreateRequest) -> None:
    """Refuse an image that is not exactly what envbuild dumped: every file, and only those,
    with the sha256 and size of the record (so its process tree, mounts and memory are the
    dumped ones), for the lock being restored."""
    record = image.record
    check_record(record)
    if image.kind != IMAGE_KIND:
        raise CheckpointRefused(f"memory image of kind {image.kind!r}: the container backend "
                                "restores CRIU images only")
    have = hash_files(image.dir)
    want: Mapping[str, Any] = record["files"]  # type: ignore[assignment]  # checked above
    if set(have) != set(want):
        extra = sorted(set(have) - set(want)) or sorted(set(want) - set(have))
        raise CheckpointRefused(f"memory image: files differ from envbuild's record "
                                f"({extra[0]}{' …' if len(extra) > 1 else ''})",
                                hint="the image was tampered with or is incomplete; "
                                     "checkpoint again")
    for name, entry in want.items():
        if not isinstance(entry, Mapping) or have[name] != {"sha256": entry.get("sha256"),
                                                            "size": entry.get("size")}:
            raise CheckpointRefused(f"memory image: {name} does not match envbuild's record "
                                    "(sha256)", hint="the image was tampered with; "
                                                     "checkpoint again")


def _comparable(mounts: list[list[str]]) -> list[tuple[str, str]]:
    # runc masks /proc paths with binds of /dev/null: the container's tmpfs /dev/null when
    # made, the host's devtmpfs one after CRIU restored them (the same empty char device)
    return [(m[0], "tmpfs" if m[0].startswith("/proc/") and m[1] == "devtmpfs" else m[1])
            for m in mounts]


def check_restored(init_pid: int, image: CheckpointImage) -> None:
    """The restored sandbox's mounts are the recorded ones (points and types; CRIU may
    mount them in another order)."""
    recorded = [list(m) for m in image.record.get("mounts", [])]  # type: ignore[attr-defined]
    have, want = sorted(_comparable(mount_table(init_pid))), sorted(_comparable(recorded))
    if have != want:
        odd = sorted(set(have) ^ set(want))
        raise CheckpointRefused("restore: the restored mounts differ from envbuild's record "
                                f"of the dump ({' '.join(map(':'.join, odd[:3]))})",
                                hint="the image was tampered with; checkpoint again")


def spawn_restore(runtime: OciRuntime, sandbox_id: str, paths: SandboxPaths,
                  image: CheckpointImage, log_fd: int, listener_fd: int) -> int:
    """``runc restore --detach`` of ``image`` into the bundle at ``paths`` (written by the
    container backend as for a fresh sandbox): the new log and agent socket stand in for the
    dumped ones (``inherit-fd``). runc's exit code; CRIU's errors are in ``criu-work``."""
    record = image.record
    work = paths.root / WORK_DIR
    work.mkdir(exist_ok=True)
    feeder = _feed_config(paths.root / CONFIG_FILE, criu_binary(), (
        f"inherit-fd fd[{INHERIT_LOG_FD}]:{record['agent_log']}\n"
        f"inherit-fd fd[{INHERIT_SOCKET_FD}]:{record['agent_socket']}\n"))
    argv = runtime.command("--criu", criu_binary(), "restore", "--detach", "--image-path",
                           str(image.dir), "--work-path", str(work), "--pid-file",
                           str(paths.init_pid), "--bundle", str(paths.bundle), sandbox_id)
    # above every target fd, so no dup2 overwrites another's source or is a no-op that keeps
    # the close-on-exec flag
    # the agent made its listener non-blocking (accept_all loops until EAGAIN); a status flag
    # of the open file, which CRIU does not set on an inherited fd
    os.set_blocking(listener_fd, False)
    high = fcntl.fcntl(listener_fd, fcntl.F_DUPFD_CLOEXEC, 10)
    high_log = fcntl.fcntl(log_fd, fcntl.F_DUPFD_CLOEXEC, 10)
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
               (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
               (os.POSIX_SPAWN_DUP2, high_log, 2),
               (os.POSIX_SPAWN_DUP2, high_log, INHERIT_LOG_FD),
               (os.POSIX_SPAWN_DUP2, high, INHERIT_SOCKET_FD)]
    try:
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions)
    finally:
        os.close(high)
        os.close(high_log)
    _, status = os.waitpid(pid, 0)
    feeder.stop()
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        # dumped inside quiesce() (the cgroup freezer): CRIU restores the cgroup frozen
        subprocess.run(runtime.command("resume", sandbox_id), capture_output=True, check=False)
    return code


class _ConfigFeeder:
    """CRIU reads an RPC config file twice (``cr-service.c``: early, then again "to overwrite
    all RPC settings") and adds each ``inherit-fd`` it reads to one list: the second copy of
    an fd it already moved to its fd store fails (``Can't send fd 8 into store: Bad file
    descriptor``). So the config is a FIFO whose first read is empty and second holds the
    options: each ``inherit-fd`` is added once."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.text = path, text
        path.unlink(missing_ok=True)
        os.mkfifo(path, 0o600)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="envbuild-criu-conf",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for content in ("", self.text):
            fd = self._open()
            if fd is None:
                return
            try:
                os.write(fd, content.encode())
            finally:
                os.close(fd)
            # the next content is for the next open: wait until this reader has gone
            while not self._stop.is_set():
                try:
                    os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
                except OSError:  # ENXIO: no reader
                    break
                time.sleep(0.001)

    def _open(self) -> int | None:
        while not self._stop.is_set():
            try:
                return os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:  # ENXIO: no reader yet
                time.sleep(0.001)
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)


class _PlainConfig:
    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        path.unlink(missing_ok=True)
        path.write_text(text)

    def stop(self) -> None:
        self.path.unlink(missing_ok=True)


def _feed_config(path: Path, binary: str, text: str) -> _ConfigFeeder | _PlainConfig:
    """The restore options for CRIU: a FIFO for CRIU < 4.2 (which reads its RPC config twice,
    ``_ConfigFeeder``), a file for later ones (which read it once)."""
    m = re.match(r"(\d+)\.(\d+)", _version(binary))
    if m and (int(m.group(1)), int(m.group(2))) < (4, 2):
        return _ConfigFeeder(path, text)
    return _PlainConfig(path, text)


def restore_refusal(sandbox_id: str, paths: SandboxPaths, image: CheckpointImage,
                    returncode: int) -> CheckpointRefused:
    """The error of a failed ``runc restore``: CRIU's first error line, naming the process."""
    return _refusal(f"restore {sandbox_id}", _errors(paths.root / WORK_DIR / "restore.log"),
                    list(image.record.get("processes", []) or []),  # type: ignore[call-overload]
                    f"runc exited {returncode}")
