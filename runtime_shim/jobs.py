"""Starting sandboxes from a training-job manifest.

The manifest model (``JobManifest``, ``SandboxGroup``, ``GroupLimits``, ``Pinned``,
``PinnedLayer``) lives with its loader in ``envbuild.jobs`` (``envbuild/jobs/model.py``, which
imports nothing of the definition or planning code); it is re-exported here so a training loop
needs one import. ``create_sandbox(group, store=..., node_dir=...)`` starts one sandbox of a
resolved group, checking the lock still closes over the pinned layers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from envbuild.jobs.model import (  # noqa: F401  (re-exported)
    API_VERSION,
    BACKENDS,
    KIND,
    GroupLimits,
    JobManifest,
    Pinned,
    PinnedLayer,
    SandboxGroup,
    format_size,
    is_digest,
    parse_size,
)

if TYPE_CHECKING:
    from envbuild.store import Store
    from runtime_shim.sdk.sandbox import Sandbox


def create_sandbox(group: SandboxGroup, *, store: Store, node_dir: str | os.PathLike[str],
                   **kwargs: Any) -> Sandbox:
    """Start one sandbox of a resolved group: its pinned lock, backend, network and limits.

    ``kwargs`` go to ``Sandbox.create`` (``runtime=``, ``keep=``, ``lazy=``). The lock is read
    once more first to check it still closes over the pinned layers (a few hundred bytes)."""
    from runtime_shim.node.locks import resolve
    from runtime_shim.sdk.sandbox import Sandbox

    group.require_resolved()
    group.check_lock(resolve(store, group.lock))
    return Sandbox.create(group.lock, store=store, node_dir=node_dir,
                          **{**group.sandbox_options(), **kwargs})
