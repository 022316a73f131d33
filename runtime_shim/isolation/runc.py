"""A small driver for an OCI runtime binary (runc by default; crun selectable).

Side effects only: write a bundle, call the runtime, clean up. What goes *into* the bundle is
decided by ``runtime_shim.isolation.spec`` (pure). Every container id envbuild creates starts with
``eb-`` so ``sandbox gc`` can tell ours from others', and runtime state lives under our own
``--root`` so a crashed process's containers can be found and deleted.

crun refuses this machine's hybrid cgroup setup unless the cgroup2 mount is hidden from it
(MACHINE-NOTES.md); ``OciRuntime.command`` wraps it in a private mount namespace that unmounts
``/sys/fs/cgroup/unified`` first.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import select
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from envbuild.atomic import write_atomic
from envbuild.errors import RuntimeShimError
from runtime_shim.isolation import cgroupfs

DEFAULT_STATE_ROOT = "/run/envbuild/runc"
#: How often a foreground container's waiter looks at its ``cancelled`` event (seconds).
CANCEL_POLL_SECONDS = 0.1


@dataclasses.dataclass(frozen=True)
class RunResult:
    exit_code: int
    duration: float
    timed_out: bool = False
    cancelled: bool = False  # the caller's ``cancelled`` event stopped it (exit_code 130)


@dataclasses.dataclass(frozen=True)
class OciRuntime:
    """Which runtime binary to call and where it keeps its state."""

    name: str = "runc"
    state_root: str = DEFAULT_STATE_ROOT

    def binary(self) -> str:
        path = shutil.which(self.name) or shutil.which(self.name, path="/usr/sbin:/sbin")
        if path is None:
            raise RuntimeShimError(f"OCI runtime {self.name!r} is not installed",
                                   hint=f"apt-get install {self.name} (or run scripts/setup.sh)")
        return path

    def command(self, *args: str) -> list[str]:
        base = [self.binary(), "--root", self.state_root, *args]
        if self.name == "crun" and os.path.ismount("/sys/fs/cgroup/unified"):
            # crun: "cgroups in hybrid mode not supported"; hide cgroup2 in a private namespace.
            script = 'umount /sys/fs/cgroup/unified 2>/dev/null; exec "$@"'
            return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *base]
        return base


#: runc's log lines: ``time="..." level=error msg="..."`` (logrus text format).
_LOGRUS_ERROR = re.compile(r'level=(?:error|fatal) msg="((?:[^"\\]|\\.)*)"')
#: The longest cause taken from a runtime's output into a one-line message.
MAX_CAUSE_CHARS = 300


def runtime_error_line(output: str) -> str | None:
    """The cause a runtime printed before it failed, as one printable line: runc's last
    ``level=error`` message, else (crun, or an unformatted message) the last non-empty line.
    ``output`` may hold what the sandbox itself wrote (its stderr shares the file), so the
    line is cut to ``MAX_CAUSE_CHARS`` and stripped of control characters."""
    found = _LOGRUS_ERROR.findall(output)
    if found:
        line = found[-1].replace('\\"', '"').replace("\\\\", "\\")
    else:
        lines = [ln for ln in output.splitlines() if ln.strip()]
        if not lines:
            return None
        line = lines[-1]
    line = "".join(c if c.isprintable() else " " for c in line).strip()
    if len(line) > MAX_CAUSE_CHARS:
        line = line[:MAX_CAUSE_CHARS - 3] + "..."
    return line or None


def write_bundle(bundle: Path, config: dict[str, Any]) -> None:
    bundle.mkdir(parents=True, exist_ok=True)
    # compact: the spec (with its seccomp profile) is written at every create; indent=1 cost 1.6 ms
    write_atomic(bundle / "config.json", json.dumps(config, separators=(",", ":")))


def run_container(
    runtime: OciRuntime,
    container_id: str,
    bundle: Path,
    *,
    stdout: BinaryIO | int | None,
    stderr: BinaryIO | int | None = subprocess.STDOUT,
    timeout: float | None = None,
    cancelled: threading.Event | None = None,
    cpu_class: str = "latency",
) -> RunResult:
    """Run the bundle's process to completion in the foreground.

    On timeout, on ``cancelled`` being set (checked every ``CANCEL_POLL_SECONDS``) or on
    KeyboardInterrupt the container is killed and deleted before returning or re-raising, so
    no runtime state or process is left behind. ``cancelled`` is how a build running on a
    worker thread is stopped: signals only interrupt the main thread. ``cpu_class``
    ``"best-effort"`` runs it under ``SCHED_IDLE`` (``runtime_shim.isolation.cpuclass.wrap_argv``).
    """
    Path(runtime.state_root).mkdir(parents=True, exist_ok=True)
    from runtime_shim.isolation import cpuclass

    argv = cpuclass.wrap_argv(runtime.command("run", "--bundle", str(bundle), container_id),
                              cpu_class)
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            start_new_session=True)
    try:
        code = _wait(proc, timeout, cancelled)
        if code is None:
            _stop(runtime, container_id, proc)
            return RunResult(exit_code=130, duration=time.monotonic() - start, cancelled=True)
        return RunResult(exit_code=code, duration=time.monotonic() - start)
    except subprocess.TimeoutExpired:
        destroy(runtime, container_id)
        proc.wait()
        return RunResult(exit_code=124, duration=time.monotonic() - start, timed_out=True)
    except BaseException:
        _stop(runtime, container_id, proc)
        raise


def _wait(proc: subprocess.Popen, timeout: float | None,
          cancelled: threading.Event | None) -> int | None:
    """``proc``'s exit code, or None once ``cancelled`` is set; TimeoutExpired after
    ``timeout``. Waits on a pidfd so a step's end is seen at once, not at the next poll."""
    if cancelled is None:
        return proc.wait(timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (old kernel): poll with short waits instead
        pidfd = None
    try:
        while not cancelled.is_set():
            left = CANCEL_POLL_SECONDS if deadline is None else \
                min(CANCEL_POLL_SECONDS, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout)  # type: ignore[arg-type]
            if pidfd is not None:
                select.select([pidfd], [], [], left)
                code = proc.poll()
                if code is not None:
                    return code
            else:
                try:
                    return proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    pass
        return None
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _stop(runtime: OciRuntime, container_id: str, proc: subprocess.Popen) -> None:
    """Kill the container and the ``runc run`` driving it, then delete the container."""
    destroy(runtime, container_id)
    proc.kill()
    proc.wait()
    # Killed while still creating the container, ``runc run`` can leave a created (not yet
    # started) container behind that the first destroy did not see yet.
    destroy(runtime, container_id)


#: The longest a ``delete`` may take: a close (also one at interpreter exit) never hangs.
DELETE_TIMEOUT = 60.0


def destroy(runtime: OciRuntime, container_id: str) -> None:
    """Kill every process of the container and delete its runtime state. Idempotent.

    ``delete --force`` SIGKILLs the init process, and with it (a new pid namespace) every
    process of the container, then removes state and cgroups: one runtime call, not two. The
    cgroups of a runtime killed mid-create (no state: ``delete`` knows no container) are
    removed by ``cgroupfs.remove``."""
    _delete(runtime, container_id, "--force")
    cgroupfs.remove(container_id)


def _delete(runtime: OciRuntime, container_id: str, *flags: str) -> int:
    """``delete`` within ``DELETE_TIMEOUT``; its exit code."""
    try:
        return subprocess.run(runtime.command("delete", *flags, container_id),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                              timeout=DELETE_TIMEOUT).returncode
    except subprocess.TimeoutExpired:
        raise RuntimeShimError(f"{runtime.name} delete {container_id} did not finish in "
                               f"{DELETE_TIMEOUT:.0f} s",
                               hint="envbuild sandbox gc retries; check the container's cgroup "
                                    "(a frozen one?)") from None


def kill_and_delete(runtime: OciRuntime, container_id: str, init_pid: int,
                    wait: float = 2.0) -> None:
    """Fast ``destroy`` when the init pid is known: SIGKILL it ourselves, wait until it is
    gone, then do what runc's ``delete`` does for a stopped container (``_forget``) without
    starting a runtime process. ``delete --force`` does the same but polls in 100 ms steps
    (~106 ms against ~8 ms measured here); it stays the fallback."""
    try:
        os.kill(init_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and _running(init_pid):
        time.sleep(0.0005)
    if _running(init_pid) or not _forget(runtime, container_id):
        if _delete(runtime, container_id) != 0:
            destroy(runtime, container_id)


def _forget(runtime: OciRuntime, container_id: str) -> bool:
    """runc's ``delete`` of a container whose processes are gone (runc 1.1 ``destroy``: remove
    its cgroups, then its state dir; our specs have no poststop hooks), done here: a runc
    process costs ~5 ms to start. Whether it was done (False: leave it to ``delete``; crun's
    state is its own)."""
    if runtime.name != "runc" or not container_id or "/" in container_id \
            or container_id in (".", ".."):
        return False
    if cgroupfs.remove(container_id, wait=0.5):
        return False  # something is still in a cgroup: runc's delete says what
    try:
        shutil.rmtree(os.path.join(runtime.state_root, container_id))
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a killed init waits to be reaped)."""
    try:
        with io.open(f"/proc/{pid}/stat", "rb") as f:  # noqa: UP020 - none at finalization
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


def list_containers(runtime: OciRuntime, prefix: str = "eb-") -> list[dict[str, Any]]:
    """Containers in our state root whose id starts with ``prefix``."""
    if not os.path.isdir(runtime.state_root):
        return []
    out = subprocess.run(runtime.command("list", "--format", "json"), capture_output=True,
                         check=False)
    if out.returncode != 0:
        raise RuntimeShimError(f"{runtime.name} list failed: {out.stderr.decode(errors='replace').strip()}")
    items = json.loads(out.stdout or b"null") or []
    return [c for c in items if c.get("id", "").startswith(prefix)]
