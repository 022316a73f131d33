"""The stub layer: mount points every container needs, as the bottom lower dir.

runc creates missing mount points (``/proc``, ``/etc/resolv.conf`` …) inside the rootfs, which
for an overlay means inside the upper dir — and from there into a built layer or a snapshot.
Putting them in a read-only bottom layer instead keeps upper dirs a pure diff. ``/.envbuild``
holds the bind-mount target of the sandbox's PID 1, the exec agent (``AGENT_PATH``, a static
binary from the host, see ``runtime_shim.isolation.agent``), so every sandbox has a PID 1 whatever its
image contains. The agent's socket is not in the sandbox at all: the host binds it in the
sandbox dir and runc passes the listening fd as ``AGENT_LISTEN_FD``.

Version 3: ``.envbuild/agent`` and ``.envbuild/run`` replace ``.envbuild/busybox``.
Version 4: ``.envbuild/run`` is gone (the socket moved out of the sandbox).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

STUB_VERSION = 4
STUB_DIRS = ("proc", "sys", "dev", "tmp", "etc", "run", ".envbuild")
STUB_FILES = ("etc/resolv.conf", "etc/hosts", "etc/hostname", ".envbuild/agent",
              ".envbuild/host-ca.crt")
#: The exec agent, PID 1 of every sandbox (read-only bind of the host's build).
AGENT_PATH = "/.envbuild/agent"
#: The fd of the agent's listening socket in the sandbox (``runc run --preserve-fds 1``).
AGENT_LISTEN_FD = 3
#: Where network-enabled build steps see the host's CA bundle (it may trust a local proxy).
HOST_CA_PATH = "/.envbuild/host-ca.crt"
#: What programs in the sandbox read to find that bundle (set to ``HOST_CA_PATH``).
CA_ENV_VARS = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
               "GIT_SSL_CAINFO", "NODE_EXTRA_CA_CERTS")


def host_ca_bundle() -> str | None:
    """The host's CA bundle file (Debian's or Red Hat's place), or None. Builds and networked
    sandboxes both bind it at ``HOST_CA_PATH``; it lives here, in the runtime, so neither
    runtime_shim nor envbuild.build needs the other for it."""
    for path in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt"):
        if os.path.isfile(path):
            return path
    return None


def ensure_stub(root: Path) -> Path:
    """The stub directory under ``root`` (created atomically on first use)."""
    stub = root / f"stub-v{STUB_VERSION}"
    if stub.is_dir():
        return stub
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".stub-{uuid.uuid4().hex}"
    for d in STUB_DIRS:
        (tmp / d).mkdir(parents=True)
    os.chmod(tmp / "tmp", 0o1777)
    for f in STUB_FILES:
        (tmp / f).touch()
    try:
        tmp.rename(stub)
    except OSError:  # another process made it first
        shutil.rmtree(tmp)
    return stub
