"""Starting sandboxes from a training-job manifest: ``create_sandbox(group, store=...,
node_dir=...)`` starts one sandbox of a resolved group, checking the lock still closes over
the pinned layers.

Jobs sit above the runtime (they read manifests, then drive ``runtime_shim``'s SDK), so this
lives here and the runtime imports nothing of ``envbuild.jobs``. It imports no definition or
planning code: a training loop needs the model and this.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envbuild.jobs.model import SandboxGroup
    from envbuild.store import Store
    from runtime_shim import Sandbox


def create_sandbox(group: SandboxGroup, *, store: Store, node_dir: str | os.PathLike[str],
                   **kwargs: Any) -> Sandbox:
    """Start one sandbox of a resolved group: its pinned lock, backend, network and limits.

    ``kwargs`` go to ``Sandbox.create`` (``runtime=``, ``keep=``, ``lazy=``). The lock is read
    once more first to check it still closes over the pinned layers (a few hundred bytes)."""
    from runtime_shim import Sandbox
    from runtime_shim.node import resolve

    group.require_resolved()
    group.check_lock(resolve(store, group.lock))
    return Sandbox.create(group.lock, store=store, node_dir=node_dir,
                          **{**group.sandbox_options(), **kwargs})
