"""A small driver for an OCI runtime binary (runc by default; crun selectable).

Side effects only: write a bundle, call the runtime, clean up. What goes *into* the bundle is
decided by ``runtime_shim.spec`` (pure). Every container id envbuild creates starts with
``eb-`` so ``sandbox gc`` can tell ours from others', and runtime state lives under our own
``--root`` so a crashed process's containers can be found and deleted.

crun refuses this machine's hybrid cgroup setup unless the cgroup2 mount is hidden from it
(MACHINE-NOTES.md); ``OciRuntime.command`` wraps it in a private mount namespace that unmounts
``/sys/fs/cgroup/unified`` first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, BinaryIO

from envbuild.errors import RuntimeShimError

DEFAULT_STATE_ROOT = "/run/envbuild/runc"


@dataclasses.dataclass(frozen=True)
class RunResult:
    exit_code: int
    duration: float
    timed_out: bool = False


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


def write_bundle(bundle: Path, config: dict[str, Any]) -> None:
    bundle.mkdir(parents=True, exist_ok=True)
    tmp = bundle / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=1))
    tmp.replace(bundle / "config.json")


def run_container(
    runtime: OciRuntime,
    container_id: str,
    bundle: Path,
    *,
    stdout: BinaryIO | int | None,
    stderr: BinaryIO | int | None = subprocess.STDOUT,
    timeout: float | None = None,
) -> RunResult:
    """Run the bundle's process to completion in the foreground.

    On timeout or KeyboardInterrupt the container is killed and deleted before returning or
    re-raising, so no runtime state or process is left behind.
    """
    Path(runtime.state_root).mkdir(parents=True, exist_ok=True)
    argv = runtime.command("run", "--bundle", str(bundle), container_id)
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
        return RunResult(exit_code=code, duration=time.monotonic() - start)
    except subprocess.TimeoutExpired:
        destroy(runtime, container_id)
        proc.wait()
        return RunResult(exit_code=124, duration=time.monotonic() - start, timed_out=True)
    except BaseException:
        destroy(runtime, container_id)
        proc.kill()
        proc.wait()
        raise


def destroy(runtime: OciRuntime, container_id: str) -> None:
    """Kill every process of the container and delete its runtime state. Idempotent."""
    subprocess.run(runtime.command("kill", "--all", container_id, "KILL"),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    subprocess.run(runtime.command("delete", "--force", container_id),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


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
