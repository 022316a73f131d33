"""The node layer: one host's state, under its node dir, that every backend is given.

Imports only ``runtime_shim.isolation`` and ``runtime_shim.lazyfs`` of the runtime (and
envbuild's ``layers``, ``store``, ``errors``, ``settings``, ``safefs``).

- ``layout``     every path under a node dir, with a version
- ``nodecache``  unpacked layers, the agent binary, the stub, scratch templates (shared, content
                 addressed)
- ``locks``      reading a lock from a store: the layers and runtime config to launch
- ``model``      the value types every layer shares: ``Limits``, ``ExecResult``, ``SandboxInfo``
- ``admission``  the node's ledger of what its sandboxes and build disks reserved of the host
- ``packdiff``   a sandbox's changes (its upper dir, hostile input) as a new layer and lock
- ``reclaim``    memory given back by idle sandboxes, and what each one holds
"""
