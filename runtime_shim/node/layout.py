"""The node dir's layout: every path under it, in one place, with a version.

A node dir (``$ENVBUILD_NODE_CACHE``, else ``envbuild.settings.default_node_dir``) is this
host's, never shared between hosts::

    layout.json          {"version": LAYOUT_VERSION}: written with the first dir below
    node/                the node cache (``runtime_shim.node.nodecache``): unpacked layers, the
                         agent binary, the stub, scratchfs templates, EROFS images, VM kernel;
                         and admission.d/, the ledger of what the node's sandboxes and
                         build disks reserved of the host (``runtime_shim.node.ledger``);
                         diskpool/, the sandboxes' disk pool (``runtime_shim.node.diskpool``)
    owners/              the sweep index: who creates sandboxes here (``runtime_shim.node.owners``)
    sandboxes/<id>/      one sandbox (``SandboxPaths``): sandbox.json, its disk, overlay, bundle
    runc/                the OCI runtime's state root (containers named by sandbox id)
    builds/              build scratch (``envbuild.build.executor``)
    restores/<random>/   a checkpoint's memory image while it is restored (0700; removed once
                         the processes run: ``runtime_shim.sdk.checkpoint.unpacked_image``)
    logs/                build step logs of a store that is not a directory

Code that needs one of these paths asks a ``NodeLayout`` (or ``SandboxPaths``) for it instead
of joining names by hand, so a successor changes the layout here and bumps the version.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from envbuild.atomic import write_atomic
from envbuild.errors import RuntimeShimError
from runtime_shim.isolation import scratchfs

LAYOUT_VERSION = 1
LAYOUT_FILE = "layout.json"


@dataclasses.dataclass(frozen=True)
class SandboxPaths:
    """Every path of one sandbox, under ``<node dir>/sandboxes/<id>``."""

    root: Path

    @property
    def id(self) -> str:
        return self.root.name

    @property
    def disk(self) -> Path:
        """Every dir the sandbox writes, capped (``runtime_shim.node.diskpool``): a symlink to
        its subvolume of the node's disk pool, or its loop disk's mount (``scratchfs``)."""
        return self.root / scratchfs.MOUNT_NAME

    @property
    def upper(self) -> Path:
        return self.disk / "upper"

    @property
    def work(self) -> Path:
        return self.disk / "work"

    @property
    def tmp(self) -> Path:
        """``/tmp`` in the sandbox: on its disk, outside the upper dir (not in snapshots)."""
        return self.disk / "tmp"

    @property
    def merged(self) -> Path:
        return self.root / "merged"

    @property
    def bundle(self) -> Path:
        return self.root / "bundle"

    @property
    def meta(self) -> Path:
        return self.root / "sandbox.json"

    @property
    def agent_socket(self) -> Path:
        """The agent's listening socket: on the host only, no mount of the sandbox has it."""
        return self.root / "agent.sock"

    @property
    def start_log(self) -> Path:
        """runc's and the agent's stderr (on the sandbox's disk: the sandbox can write it)."""
        return self.disk / "start.log"

    @property
    def init_pid(self) -> Path:
        return self.root / "init.pid"


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """The paths of one node dir (pure: nothing is created until ``ensure``)."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def version_file(self) -> Path:
        return self.root / LAYOUT_FILE

    @property
    def node(self) -> Path:
        """The node cache's root (``runtime_shim.node.nodecache.NodeCache``)."""
        return self.root / "node"

    @property
    def sandboxes(self) -> Path:
        return self.root / "sandboxes"

    @property
    def runc(self) -> Path:
        """The OCI runtime's ``--root``: its state of every container of this node."""
        return self.root / "runc"

    @property
    def disk_pool(self) -> Path:
        """The sandboxes' disk pool (``runtime_shim.node.diskpool``): ``pool.img``, its mount
        ``mnt/`` (one subvolume per sandbox) and ``lock``."""
        return self.node / "diskpool"

    @property
    def builds(self) -> Path:
        return self.root / "builds"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def restores(self) -> Path:
        return self.root / "restores"

    @property
    def owners(self) -> Path:
        """The index of the processes that create sandboxes here (``runtime_shim.node.owners``):
        what lets the sweep at each create skip reading every sandbox's record."""
        return self.root / "owners"

    @property
    def grades(self) -> Path:
        """Scratch of the grader (``runtime_shim.grading``): an agent's changes while they are
        read and filtered (mode 0700: they are the agent's files)."""
        return self.root / "grades"

    def sandbox(self, sandbox_id: str) -> SandboxPaths:
        if not sandbox_id or "/" in sandbox_id or sandbox_id in (".", ".."):
            raise RuntimeShimError(f"not a sandbox id: {sandbox_id!r}",
                                   hint="envbuild sandbox ls lists them")
        return SandboxPaths(self.sandboxes / sandbox_id)

    def ensure(self) -> NodeLayout:
        """Create the node dir and record its layout version, or check the recorded one.

        ``sandboxes/`` is the node's only (mode 0700): a sandbox's dir holds its merged root
        (the agent's files), its QMP and agent sockets; no other local user may enter it."""
        self._check_version()
        self.sandboxes.mkdir(mode=0o700, exist_ok=True)
        st = self.sandboxes.stat()
        if st.st_mode & 0o077 and st.st_uid == os.geteuid():
            os.chmod(self.sandboxes, 0o700)   # made by an older envbuild: 0755
        return self

    def _check_version(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            version = json.loads(self.version_file.read_text()).get("version")
        except FileNotFoundError:
            # concurrent creates (threads of one process too) race here: each its own temp
            write_atomic(self.version_file, json.dumps({"version": LAYOUT_VERSION}))
            return
        except (OSError, ValueError, AttributeError):
            version = None
        if version != LAYOUT_VERSION:
            raise RuntimeShimError(
                f"node dir {self.root} has layout version {version!r}; this envbuild "
                f"uses {LAYOUT_VERSION}",
                hint="point ENVBUILD_NODE_CACHE at a fresh dir (a node dir is a cache: "
                     "deleting it is safe once no sandbox runs)")


def default_layout() -> NodeLayout:
    """The node dir the CLI uses: ``$ENVBUILD_NODE_CACHE``, else the settings default."""
    from envbuild.settings import default_node_dir

    return NodeLayout(default_node_dir(os.environ))
