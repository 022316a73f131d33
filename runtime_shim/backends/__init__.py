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
