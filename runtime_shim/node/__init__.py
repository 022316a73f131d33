"""The node layer: one host's state, under its node dir, that every backend is given.

Imports only ``runtime_shim.isolation`` and ``runtime_shim.lazyfs`` of the runtime (and
envbuild's ``layers``, ``store``, ``errors``, ``settings``, ``safefs``).

- ``layout``     every path under a node dir, with a version
- ``nodecache``  unpacked layers, the agent binary, the stub, scratch templates (shared, content
                 addressed)
- ``locks``      reading a lock from a store: the layers and runtime config to launch
- ``model``      the value types every layer shares: ``Limits``, ``ExecResult``, ``SandboxInfo``
- ``admission``  the node's ledger of what its sandboxes and build disks reserved of the host
- ``diskpool``   each sandbox's capped disk: a subvolume of the node's btrfs pool, or a loop disk
- ``packdiff``   a sandbox's changes (its upper dir, hostile input) as a new layer and lock
- ``reclaim``    memory given back by idle sandboxes, and what each one holds
- ``tasklock``   task locks: a task's env lock, hidden layer and grading spec, in the store
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from envbuild._lazy import lazy_exports

# The surface the rest of envbuild (the build, the CLI, job manifests) uses. Imported on first
# use, so ``import runtime_shim.node`` loads nothing else.
_EXPORTS = {
    **{name: "runtime_shim.node.admission" for name in (
        "BudgetSettings", "Reservation", "build_key")},
    "hold_pools": "runtime_shim.node.diskpool",
    "Ledger": "runtime_shim.node.ledger",
    "NodeLayout": "runtime_shim.node.layout",
    **{name: "runtime_shim.node.locks" for name in ("MAX_LOCK_JSON", "ResolvedLock", "resolve")},
    "Limits": "runtime_shim.node.model",
    **{name: "runtime_shim.node.nodecache" for name in ("NodeCache", "parse_size")},
    **{name: "runtime_shim.node.packdiff" for name in ("SnapshotPolicy", "squash_snapshots")},
    **{name: "runtime_shim.node.tasklock" for name in (
        "HiddenLayer", "TASK_REF_PREFIX", "TaskLock", "TaskSpec", "load_task", "publish_task")},
    **{name: "runtime_shim.node.records" for name in (
        "layers_in_use", "list_sandboxes", "set_sandbox_network")},
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from runtime_shim.node.admission import (  # noqa: F401
        BudgetSettings,
        Reservation,
        build_key,
    )
    from runtime_shim.node.diskpool import hold_pools  # noqa: F401
    from runtime_shim.node.layout import NodeLayout  # noqa: F401
    from runtime_shim.node.ledger import Ledger  # noqa: F401
    from runtime_shim.node.locks import MAX_LOCK_JSON, ResolvedLock, resolve  # noqa: F401
    from runtime_shim.node.model import Limits  # noqa: F401
    from runtime_shim.node.nodecache import NodeCache, parse_size  # noqa: F401
    from runtime_shim.node.packdiff import SnapshotPolicy, squash_snapshots  # noqa: F401
    from runtime_shim.node.records import (  # noqa: F401
        layers_in_use,
        list_sandboxes,
        set_sandbox_network,
    )
    from runtime_shim.node.tasklock import (  # noqa: F401
        TASK_REF_PREFIX,
        HiddenLayer,
        TaskLock,
        TaskSpec,
        load_task,
        publish_task,
    )

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
