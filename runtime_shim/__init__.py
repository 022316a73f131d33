"""runtime_shim: turns locks into running, isolated, disposable sandboxes.

Imports only envbuild.layers, envbuild.store and envbuild.errors (see docs/DESIGN dependency rule).
The sandbox SDK arrives with the runtime-shim issue; this package is a placeholder until then.
"""

__all__: list[str] = []
