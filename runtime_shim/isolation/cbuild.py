"""The host's small static C helpers, compiled once per source.

They are the exec agent (``runtime_shim.isolation.agent.agent_binary``) and the FnCall spawner
(``runtime_shim.isolation.fncall_ns.spawner_binary``).

``static_binary`` compiles a C source (libc only) with gcc against static glibc into
``<cache_dir>/agent/<key>/<name>`` (compile beside, rename into place), so every sandbox on the
host bind-mounts the same file; ``key`` is ``source_key(source)``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from envbuild.errors import RuntimeShimError

CFLAGS = ("-static", "-O2", "-Wall", "-Wextra", "-Werror")
# The key covers what decides the binary's behaviour: the source and the flags. The compiler
# version is left out on purpose: another gcc builds the same program.
KEY_TAG = "envbuild.agent.v1"


def source_key(source: Path) -> str:
    """The cache key of ``source`` built with ``CFLAGS``."""
    h = hashlib.sha256(KEY_TAG.encode())
    h.update(" ".join(CFLAGS).encode() + b"\0")
    h.update(source.read_bytes())
    return h.hexdigest()[:16]


def static_binary(cache_dir: str | os.PathLike[str], source: Path, name: str, key: str,
                  what: str) -> Path:
    """``source`` (C, libc only) compiled static as ``<cache_dir>/agent/<key>/<name>`` on
    first use (``key``: ``source_key(source)``); ``what`` names it in errors."""
    target = Path(cache_dir) / "agent" / key / name
    if target.is_file():
        return target
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeShimError(f"build {what}: gcc is not installed",
                               hint="apt-get install gcc libc6-dev (or run scripts/setup.sh)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{name}-{uuid.uuid4().hex[:8]}")
    argv = [gcc, *CFLAGS, "-o", str(tmp), str(source)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            output = (proc.stderr + proc.stdout).strip()
            hint = "run scripts/setup.sh"
            if "cannot find -lc" in output or "stdio.h" in output:
                hint = ("static linking needs glibc's static library and headers: "
                        "apt-get install libc6-dev (or run scripts/setup.sh)")
            raise RuntimeShimError(
                f"build {what}: gcc exited {proc.returncode}",
                context=f"$ {' '.join(argv)}\n{output[-3000:]}", hint=hint)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
        tmp.replace(target)  # another process may have won: same bytes, either is fine
    finally:
        tmp.unlink(missing_ok=True)
    return target


__all__ = ["CFLAGS", "KEY_TAG", "source_key", "static_binary"]
