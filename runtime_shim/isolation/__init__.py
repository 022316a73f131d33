"""The isolation layer: the host mechanisms a sandbox is made of, one module each.

The bottom of ``runtime_shim``: it imports nothing of the layers above (``node``,
``backends``, ``sdk``, ``fleet``, ``lazyfs``) and knows no sandbox records, stores or locks.

- ``runc``       the OCI runtime: bundles, ``run``/``create``/``delete``, the containers it lists
- ``spec``       a runtime spec (``config.json``) from limits, mounts and a user (pure)
- ``mount``      overlay and bind mounts, unmounting, what is mounted under a dir
- ``mountns``    a step run in a mount namespace of its own (a sandbox's overlay)
- ``netns``      a sandbox's own network namespace, its egress policy and user-mode NAT
- ``seccomp``    the default syscall filter and checks of a caller's own
- ``scratchfs``  capped scratch disks (a loop-mounted ext4 per build step, or per sandbox)
- ``quotafs``    per-sandbox caps as btrfs quota groups on one shared filesystem
- ``cgroupfs``   reading and removing a container's cgroups
- ``cpuclass``   CPU classes (weights, ``SCHED_IDLE`` for builds)
- ``fsaccess``   reading and writing files inside a sandbox root without leaving it
- ``stub``       the bottom lower dir every container gets (mount points, the agent's place)
- ``agent``      the exec agent (PID 1 of a sandbox): its build and its protocol, host side;
                 ``agent/`` holds its C source and the protocol's specification
- ``fncall_ns``  the namespaces each FnCall call runs in
- ``lifecycle``  what becomes of a process's sandboxes when it exits
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from envbuild._lazy import lazy_exports

# The surface the rest of envbuild (the build's executor, the private dockerd) uses; its
# modules ``cpuclass``, ``netns`` and ``scratchfs`` are public as a whole. Imported on first use.
_EXPORTS = {
    **{name: "runtime_shim.isolation.mount" for name in (
        "OverlaySpec", "mount_overlay", "mounted_targets_under", "unmount")},
    **{name: "runtime_shim.isolation.runc" for name in (
        "OciRuntime", "destroy", "list_containers", "run_container", "write_bundle")},
    **{name: "runtime_shim.isolation.spec" for name in (
        "BindMount", "RuntimeSpecRequest", "clamped_rlimit", "env_list", "parse_user",
        "runtime_spec")},
    **{name: "runtime_shim.isolation.stub" for name in (
        "CA_ENV_VARS", "HOST_CA_PATH", "ensure_stub", "host_ca_bundle")},
    "copy_capped": "runtime_shim.isolation.scratchfs",
}
__all__ = sorted([*_EXPORTS, "cpuclass", "netns", "scratchfs"])

if TYPE_CHECKING:
    from runtime_shim.isolation import cpuclass, netns, scratchfs  # noqa: F401
    from runtime_shim.isolation.mount import (  # noqa: F401
        OverlaySpec,
        mount_overlay,
        mounted_targets_under,
        unmount,
    )
    from runtime_shim.isolation.runc import (  # noqa: F401
        OciRuntime,
        destroy,
        list_containers,
        run_container,
        write_bundle,
    )
    from runtime_shim.isolation.scratchfs import copy_capped  # noqa: F401
    from runtime_shim.isolation.spec import (  # noqa: F401
        BindMount,
        RuntimeSpecRequest,
        clamped_rlimit,
        env_list,
        parse_user,
        runtime_spec,
    )
    from runtime_shim.isolation.stub import (  # noqa: F401
        CA_ENV_VARS,
        HOST_CA_PATH,
        ensure_stub,
        host_ca_bundle,
    )

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
