"""A Docker daemon to drive: the user's (``DOCKER_HOST``), or a throwaway ``dockerd`` of our own.

``docker_daemon(root)`` is the one entry point (a context manager yielding a ``DockerDaemon``):

- ``DOCKER_HOST`` set: that daemon is used as it is; it must answer ``docker version`` within
  ``USER_DAEMON_TIMEOUT`` seconds or the build fails with one line saying so. Nothing of it is
  started or stopped.
- otherwise a **private dockerd** (Debian's ``docker.io``) is started for the length of the
  ``with`` block and stopped at its end, also on an exception or Ctrl-C:

  - everything it writes lives in one fresh directory ``ROOT/dockerd-<id>/``: ``data/``
    (``--data-root``: images, BuildKit's cache, the files its ``RUN`` steps write), unless
    the caller names another ``data_root`` (a build's size-capped scratch disk, so a
    ``RUN dd ...`` meets ``ENOSPC`` at the layer's cap instead of filling the host: issue 34,
    item 4; its path is recorded in ``data-root`` for the sweep), ``dockerd.pid``, ``dockerd.log``,
    ``daemon.json`` (empty: the host's ``/etc/docker/daemon.json`` is never read), ``config/``
    (``DOCKER_CONFIG`` of the CLI: no host credentials reach the build), and ``x/``
    (``--exec-root``: the API socket ``x/docker.sock`` and the state of the containerd that
    dockerd starts for itself). A unix socket path is limited to 108 bytes, so when ``ROOT`` is
    too deep for containerd's socket (``x/containerd/containerd.sock.ttrpc``), the exec root
    is ``/run/envbuild-dockerd-<id>`` instead (removed the same way);
  - it listens on that unix socket only (no TCP) and does not touch the host's network:
    ``--bridge=none --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false
    --userland-proxy=false``; builds therefore pass ``--network=none`` or ``--network=host``
    (the default bridge network does not exist). With ``egress_only`` the daemon runs in a
    network namespace of its own behind slirp4netns (``runtime_shim.isolation.netns``: egress, the
    host's addresses, its loopback and link-local refused), so "host" networking of its
    containers is that namespace, never the host's;
  - its containers' cgroups, BuildKit's ``RUN`` steps included, live under
    ``/envbuild-dockerd-<id>`` (``--cgroup-parent``), created first with ``DaemonLimits``
    (8 GiB, 8192 tasks, 4 CPUs by default) and removed afterwards;
  - it is ready when ``GET /_ping`` on its socket answers 200, within ``start_timeout``
    (default 60 s; it takes 1–8 s here). If it exits first or the time runs out, the error
    carries the tail of its log and a hint;
  - stop: SIGTERM, up to ``stop_timeout`` seconds, then SIGKILL; then every process whose
    command line names its directory (its containerd, shims) is killed, mounts below its
    directories are detached, its cgroups removed, its directories deleted;
  - ``ROOT/dockerd-<id>.owner`` is flocked while it runs: if envbuild dies without
    stopping it (SIGKILL), the next private daemon under ``ROOT`` finds the lock free and
    removes the orphan the same way (``sweep_stale_daemons``).

  dockerd 20.10 itself still writes two host files no flag moves: ``/etc/docker/key.json``
  (its trust key) and the empty directory ``/run/docker/plugins``; both are harmless and
  shared by every dockerd of the machine, so they are left alone.

The CLI is Debian's ``/usr/bin/docker`` (its ``docker build`` speaks BuildKit with
``DOCKER_BUILDKIT=1``; a newer static CLI elsewhere on ``PATH`` wants the buildx plugin), or
``$ENVBUILD_DOCKER``; the daemon is ``dockerd`` on ``PATH`` or ``$ENVBUILD_DOCKERD``. Reusable:
anything that needs a Docker daemon for a while (a comparison against ``docker build``) can
``with docker_daemon(path) as d: subprocess.run([d.cli, ...], env=d.env())``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

from envbuild.errors import BuildError

USER_DAEMON_TIMEOUT = 20.0
DEFAULT_START_TIMEOUT = 60.0
DEFAULT_STOP_TIMEOUT = 30.0
LOG_TAIL_LINES = 20
# sun_path is 108 bytes with its NUL, but containerd 1.6 already failed to start ("timeout
# waiting for containerd to start") with its longest socket path at 105 bytes, and started at
# 98: keep a margin rather than sit on the kernel's limit.
_SOCKET_PATH_MAX = 96
_CONTAINERD_SOCKET = "containerd/containerd.sock.ttrpc"
_DOCKERD_FLAGS = ("--iptables=false", "--ip6tables=false", "--ip-forward=false",
                  "--ip-masq=false", "--bridge=none", "--userland-proxy=false")


@dataclasses.dataclass(frozen=True)
class DaemonLimits:
    """Limits of everything a private daemon runs (its containers and BuildKit's ``RUN``
    steps, all in its cgroup parent): the same defaults as envbuild's own build steps
    (``envbuild.build.executor.BuildLimits``), because a Dockerfile is untrusted input.
    ``$ENVBUILD_DOCKER_MEMORY`` (bytes), ``$ENVBUILD_DOCKER_PIDS``, ``$ENVBUILD_DOCKER_CPUS``
    override them; 0 leaves one off."""

    memory_bytes: int = 8 << 30
    pids: int = 8192
    cpus: float = 4.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> DaemonLimits:
        d = cls()
        try:
            return cls(memory_bytes=int(environ.get("ENVBUILD_DOCKER_MEMORY") or d.memory_bytes),
                       pids=int(environ.get("ENVBUILD_DOCKER_PIDS") or d.pids),
                       cpus=float(environ.get("ENVBUILD_DOCKER_CPUS") or d.cpus))
        except ValueError as e:
            from envbuild.errors import SettingsError

            raise SettingsError(f"ENVBUILD_DOCKER_MEMORY/PIDS/CPUS: {e}") from None


def _limit_cgroup(cgroup: str, limits: DaemonLimits) -> None:
    """Create ``cgroup`` with ``limits`` in each cgroup v1 controller the host mounts (dockerd
    20.10 uses v1 on this hybrid host) or, on a pure v2 host, in the unified tree."""
    base = Path("/sys/fs/cgroup")
    name = cgroup.lstrip("/")
    writes: list[tuple[Path, str, str]] = []
    if (base / "memory").is_dir() or (base / "pids").is_dir():
        if limits.memory_bytes:
            writes.append((base / "memory", "memory.limit_in_bytes", str(limits.memory_bytes)))
        if limits.pids:
            writes.append((base / "pids", "pids.max", str(limits.pids)))
        if limits.cpus:
            writes += [(base / "cpu", "cpu.cfs_period_us", "100000"),
                       (base / "cpu", "cpu.cfs_quota_us", str(int(limits.cpus * 100000)))]
    elif (base / "cgroup.controllers").is_file():
        if limits.memory_bytes:
            writes.append((base, "memory.max", str(limits.memory_bytes)))
        if limits.pids:
            writes.append((base, "pids.max", str(limits.pids)))
        if limits.cpus:
            writes.append((base, "cpu.max", f"{int(limits.cpus * 100000)} 100000"))
    for hierarchy, knob, value in writes:
        if not hierarchy.is_dir():
            continue
        d = hierarchy / name
        try:
            d.mkdir(exist_ok=True)
            (d / knob).write_text(value)
        except OSError as e:
            raise BuildError(f"limit the private dockerd: write {d / knob}: {e.strerror}",
                             hint="envbuild runs dockerd as root on a host with cgroups") from None


@dataclasses.dataclass(frozen=True)
class DockerDaemon:
    """A daemon to talk to: ``host`` is a ``DOCKER_HOST`` value; ``private`` says envbuild
    started it (and will remove it with everything in it); ``config_dir`` is the CLI's
    ``DOCKER_CONFIG`` (None: the user's own)."""

    host: str
    cli: str
    private: bool
    config_dir: str | None = None
    log: str | None = None

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a ``docker`` CLI subprocess aimed at this daemon."""
        env = dict(os.environ if base is None else base)
        env["DOCKER_HOST"] = self.host
        env["DOCKER_BUILDKIT"] = "1"
        env.pop("DOCKER_CONTEXT", None)
        if self.config_dir is not None:
            env["DOCKER_CONFIG"] = self.config_dir
        return env


def docker_cli() -> str:
    """The docker CLI to drive (see the module docstring)."""
    chosen = os.environ.get("ENVBUILD_DOCKER") or (
        "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker"))
    if not chosen:
        raise BuildError("the docker CLI is not installed",
                         hint="apt-get install docker.io (scripts/setup.sh installs it)")
    return chosen


def dockerd_binary() -> str:
    chosen = os.environ.get("ENVBUILD_DOCKERD") or shutil.which("dockerd") or (
        "/usr/sbin/dockerd" if os.access("/usr/sbin/dockerd", os.X_OK) else None)
    if not chosen:
        raise BuildError("dockerd is not installed (no Docker daemon to build with)",
                         hint="apt-get install docker.io, or point DOCKER_HOST at a daemon")
    return chosen


@contextlib.contextmanager
def docker_daemon(root: Path, *, start_timeout: float = DEFAULT_START_TIMEOUT,
                  stop_timeout: float = DEFAULT_STOP_TIMEOUT,
                  limits: DaemonLimits | None = None,
                  egress_only: bool = False,
                  data_root: Path | None = None) -> Iterator[DockerDaemon]:
    """The user's daemon if ``DOCKER_HOST`` is set, else a private dockerd under ``root``
    (its images and build files in ``data_root`` if given, a fresh directory)."""
    host = os.environ.get("DOCKER_HOST", "").strip()
    if host:
        yield _user_daemon(host)
        return
    with private_daemon(root, start_timeout=start_timeout, stop_timeout=stop_timeout,
                        limits=limits, egress_only=egress_only, data_root=data_root) as d:
        yield d


def _user_daemon(host: str) -> DockerDaemon:
    d = DockerDaemon(host=host, cli=docker_cli(), private=False)
    try:
        done = subprocess.run([d.cli, "version", "--format", "{{.Server.Version}}"],
                              env=d.env(), capture_output=True, text=True,
                              timeout=USER_DAEMON_TIMEOUT, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise BuildError(f"the Docker daemon at DOCKER_HOST={host} did not answer in "
                         f"{USER_DAEMON_TIMEOUT:.0f} s",
                         hint="start it, or unset DOCKER_HOST to let envbuild run its own") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"the Docker daemon at DOCKER_HOST={host} does not answer: {last}",
                         hint="start it, or unset DOCKER_HOST to let envbuild run its own")
    return d


@contextlib.contextmanager
def private_daemon(root: Path, *, start_timeout: float = DEFAULT_START_TIMEOUT,
                   stop_timeout: float = DEFAULT_STOP_TIMEOUT,
                   limits: DaemonLimits | None = None,
                   egress_only: bool = False,
                   data_root: Path | None = None) -> Iterator[DockerDaemon]:
    """Start a throwaway dockerd under ``root``, yield it ready, stop and remove it. With
    ``egress_only`` it runs in a network namespace of its own behind slirp4netns
    (``runtime_shim.isolation.netns``: the host's addresses and loopback refused), so that
    ``--network=host`` steps get egress, not the host. ``data_root`` (a directory that must
    not exist yet, e.g. on a build's capped disk) holds everything the daemon stores; it is
    removed with the daemon."""
    binary = dockerd_binary()
    cli = docker_cli()
    ident = uuid.uuid4().hex[:12]
    root.mkdir(parents=True, exist_ok=True)
    sweep_stale_daemons(root)
    top = Path(os.path.abspath(root)) / f"dockerd-{ident}"
    exec_root = _exec_root(top, ident)
    sock = exec_root / "docker.sock"
    cgroup = f"/envbuild-dockerd-{ident}"
    owner = _claim(top)
    top.mkdir(mode=0o700)
    proc: subprocess.Popen | None = None
    net = None
    try:
        _limit_cgroup(cgroup, limits or DaemonLimits.from_env(os.environ))
        exec_root.mkdir(mode=0o700, exist_ok=exec_root.parent == top)
        (top / "config").mkdir(mode=0o700)
        data = _place_data_root(top, data_root)
        (top / "daemon.json").write_text("{}\n")
        (top / "config" / "config.json").write_text("{}\n")
        log_path = top / "dockerd.log"
        prefix: list[str] = []
        if egress_only:
            from runtime_shim.isolation import netns

            (top / "net").mkdir(mode=0o700)
            net = netns.create(top / "net", netns.NetworkPolicy())
            prefix = ["nsenter", f"--net={net.path}", "--"]
        argv = [*prefix, binary, "--config-file", str(top / "daemon.json"),
                "--data-root", str(data), "--exec-root", str(exec_root),
                "--pidfile", str(top / "dockerd.pid"), "-H", f"unix://{sock}",
                f"--cgroup-parent={cgroup}", *_DOCKERD_FLAGS]
        with open(log_path, "ab") as log:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        start_new_session=True)
            except OSError as e:
                raise BuildError(f"start dockerd: {e.strerror or e}",
                                 hint="apt-get install docker.io") from None
        _wait_ready(proc, sock, log_path, start_timeout)
        yield DockerDaemon(host=f"unix://{sock}", cli=cli, private=True,
                           config_dir=str(top / "config"), log=str(log_path))
    finally:
        _teardown(top, ident, proc, stop_timeout)
        if net is not None:
            net.close()  # its exit fd; the namespace itself went with the teardown
        os.unlink(f"{top}{OWNER_SUFFIX}")
        os.close(owner)


OWNER_SUFFIX = ".owner"


def _exec_root(top: Path, ident: str) -> Path:
    exec_root = top / "x"
    if len(str(exec_root / _CONTAINERD_SOCKET)) > _SOCKET_PATH_MAX:
        exec_root = Path(f"/run/envbuild-dockerd-{ident}")
    return exec_root


def _claim(top: Path) -> int:
    """The owner file ``top.owner``, flocked for the daemon's life: a sweeper that can lock it
    knows the envbuild that started the daemon is gone (the kernel drops the lock)."""
    tmp = Path(f"{top}{OWNER_SUFFIX}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"%d\n" % os.getpid())
    os.rename(tmp, f"{top}{OWNER_SUFFIX}")
    return fd


_DATA_ROOT_RECORD = "data-root"


def _place_data_root(top: Path, data_root: Path | None) -> Path:
    """The daemon's ``--data-root``: ``top/data``, or ``data_root`` (created here, recorded
    in ``top/data-root`` before the daemon can write to it, so a sweep after a crash finds
    and removes it too)."""
    if data_root is None:
        (top / "data").mkdir(mode=0o700)
        return top / "data"
    data = Path(os.path.abspath(data_root))
    (top / _DATA_ROOT_RECORD).write_text(f"{data}\n")
    data.mkdir(mode=0o700, parents=True)
    return data


def _data_root_of(top: Path) -> Path | None:
    """The data root recorded for the daemon in ``top`` (None: ``top/data``, or none)."""
    try:
        text = (top / _DATA_ROOT_RECORD).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return Path(text) if os.path.isabs(text) and "\0" not in text else None


def _teardown(top: Path, ident: str, proc: subprocess.Popen | None, stop_timeout: float) -> None:
    exec_root = _exec_root(top, ident)
    data = _data_root_of(top)
    dirs = (top, exec_root) if data is None else (top, exec_root, data)
    _stop(proc, stop_timeout, dirs)
    _remove_cgroups(f"/envbuild-dockerd-{ident}")
    if (top / "net").is_dir():  # egress_only: slirp4netns and the namespace file
        from runtime_shim.isolation import netns

        with contextlib.suppress(Exception):
            netns.teardown(top / "net")
    for d in (exec_root, *([data] if data is not None else []), top):
        _remove_dir(d)


def sweep_stale_daemons(root: Path) -> list[str]:
    """Remove the private daemons under ``root`` whose envbuild died without stopping them
    (SIGKILL, OOM): their owner file can be locked. Their processes are killed (found by the
    directory names on their command lines, never by a program name), mounts detached, cgroups
    and directories removed. Returns the ids removed."""
    removed: list[str] = []
    try:
        names = [e.name for e in os.scandir(root)
                 if e.name.startswith("dockerd-") and e.name.endswith(OWNER_SUFFIX)]
    except FileNotFoundError:
        return removed
    for name in names:
        path = root / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # alive
            top = Path(os.path.abspath(root)) / name[:-len(OWNER_SUFFIX)]
            ident = top.name.removeprefix("dockerd-")
            if not re.fullmatch(r"[0-9a-f]{12}", ident):
                continue
            pid = _read_pid(top / "dockerd.pid")
            if pid is not None and top.is_dir() and os.fsencode(str(top)) in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                _wait_gone(pid, DEFAULT_STOP_TIMEOUT)
            _teardown(top, ident, None, 0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            removed.append(ident)
        finally:
            os.close(fd)
    return removed


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _cmdline(pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _wait_ready(proc: subprocess.Popen, sock: Path, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll()
        if code is not None:
            raise BuildError(f"dockerd exited {code} before it answered", context=_tail(log),
                             hint=f"its log: {log} (is another dockerd using the same dirs, "
                                  "or is the kernel missing overlayfs?)")
        if sock.exists() and _ping(sock):
            return
        if time.monotonic() > deadline:
            raise BuildError(f"dockerd did not answer within {timeout:.0f} s",
                             context=_tail(log),
                             hint=f"its log: {log} (a loaded machine may need more time)")
        time.sleep(0.1)


def _ping(sock: Path) -> bool:
    """``GET /_ping`` on the daemon's socket answers 200."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(sock))
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            data = s.recv(64)
    except OSError:
        return False
    return data.startswith(b"HTTP/1.") and b" 200 " in data[:16]


def _tail(log: Path) -> str:
    from envbuild.safefs import read_tail  # imported where used, as remove_tree below

    try:
        text = read_tail(log, 64 * 1024)
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])


def _stop(proc: subprocess.Popen | None, timeout: float, dirs: tuple[Path, ...]) -> None:
    """Stop dockerd, then whatever still runs from its directories (its containerd and
    shims are started in sessions of their own, so a process group does not reach them)."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for _ in range(50):
        left = _processes_naming(dirs)
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _processes_naming(dirs: tuple[Path, ...]) -> list[int]:
    """Pids whose command line names one of ``dirs`` (only ours: each is unique per daemon)."""
    needles = [os.fsencode(f"{d}/") for d in dirs] + [os.fsencode(str(d)) + b"\0" for d in dirs]
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read() + b"\0"
        except OSError:
            continue
        if any(n in cmdline for n in needles):
            found.append(int(name))
    return found


def mounts_under(paths: tuple[Path, ...]) -> list[str]:
    """Mount points at or below any of ``paths``, deepest first."""
    prefixes = [str(p).rstrip("/") for p in paths]
    out = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            target = line.split(b" ")[4].decode(errors="replace")
            target = target.replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            if any(target == p or target.startswith(p + "/") for p in prefixes):
                out.append(target)
    return sorted(set(out), key=lambda t: t.count("/"), reverse=True)


def _remove_dir(d: Path) -> None:
    from envbuild.safefs import remove_tree
    from runtime_shim.isolation import unmount

    for target in mounts_under((d,)):
        with contextlib.suppress(Exception):
            unmount(target)
    if d.exists():
        with contextlib.suppress(FileNotFoundError):
            remove_tree(d)


def _remove_cgroups(cgroup: str, patience: float = 2.0) -> None:
    """rmdir ``cgroup`` (and its empty children, deepest first) in every hierarchy; a cgroup
    whose killed tasks are still exiting is busy (EBUSY) for a moment: retried for up to
    ``patience`` seconds (a CI run once found a timed-out build's cpuset cgroup left)."""
    base = Path("/sys/fs/cgroup")
    try:
        hierarchies = [base] + [p for p in base.iterdir() if p.is_dir()]
    except OSError:
        return
    deadline = time.monotonic() + patience
    for h in hierarchies:
        top = h / cgroup.lstrip("/")
        if not top.is_dir():
            continue
        dirs = [Path(dp) for dp, _dn, _fn in os.walk(top)]
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            _rmdir_when_idle(d, deadline)


def _rmdir_when_idle(cgroup_dir: Path, deadline: float) -> None:
    while True:
        try:
            cgroup_dir.rmdir()
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                return
        time.sleep(0.05)
