"""Sandbox fleets across a Ray cluster: one SDK for a trainer on one machine and sandboxes on
many.

``Fleet.connect(address=..., store=...)`` (``runtime_shim.fleet.client``) talks to one node
daemon per Ray node that offers the custom resource ``envbuild_node``
(``runtime_shim.fleet.daemon``: a named, detached actor that owns that node's node cache and
sandboxes, made through the SDK's backend registry). ``fleet.create(lock, n=...)`` places the
sandboxes by free capacity and layer locality (``runtime_shim.fleet.placement``, pure), one
batched call per node, and returns ``FleetSandbox`` handles with the ``Sandbox`` methods.
Sandboxes belong to the daemons, so a new driver ``attach``es to those of a killed one.
Exec logs and replay: ``runtime_shim.fleet.execlog``. The client's parts: ``cluster`` (Ray, the
daemons, calls with deadlines), ``calls`` (the transport: Ray's, or in-process daemons for
tests and ``benchmarks/cell_sim.py``), ``view`` (node loads reused between status calls) and
``handle`` (the sandbox handles); the daemon's: ``leases`` (records, leases, re-adoption, the
entry table) and ``pools`` (warm pools); the data both exchange: ``model``.

Ray is imported only when a fleet is used: ``import runtime_shim.fleet`` itself loads nothing
of it.
"""

from __future__ import annotations

from envbuild._lazy import lazy_exports

_EXPORTS = {
    "Fleet": "runtime_shim.fleet.client",
    "FleetSandbox": "runtime_shim.fleet.handle",
    "AsyncFleetSandbox": "runtime_shim.fleet.handle",
    "CreateSpec": "runtime_shim.fleet.model",
    "DaemonConfig": "runtime_shim.fleet.model",
    "NodeStatus": "runtime_shim.fleet.model",
    "SandboxRecord": "runtime_shim.fleet.model",
    "start_daemons": "runtime_shim.fleet.cluster",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
