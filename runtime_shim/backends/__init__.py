"""The backends: what runs a sandbox, behind the protocols of ``base``.

Imports ``runtime_shim.node`` and ``runtime_shim.isolation`` below it, never the SDK above it.

- ``base``       the protocols a backend implements (``Backend``, ``SandboxHandle`` and the
                 optional capabilities) and the one registry of backends
- ``container``  a container under an OCI runtime (runc), the default
- ``criu``       the container's checkpoint and restore with CRIU
- ``fncall``     FnCall sandboxes: one warm container serving stateless calls
- ``vm``         microVMs under QEMU
- ``fake``       ``FakeBackend``: no runtime behind it, for fast tests of the SDK
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from envbuild._lazy import lazy_exports

# The registry, for the rest of envbuild (the CLI's --backend). Imported on first use.
__all__ = ["backend_names", "get_backend", "register"]

if TYPE_CHECKING:
    from runtime_shim.backends.base import backend_names, get_backend, register  # noqa: F401

__getattr__, __dir__ = lazy_exports(__name__, {name: "runtime_shim.backends.base"
                                               for name in __all__})
