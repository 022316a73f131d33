"""The SDK layer: ``Sandbox`` and ``AsyncSandbox``, what a training loop calls.

The top of ``runtime_shim`` below the fleet: it drives every backend through
``runtime_shim.backends.base``'s protocols. Its public names are re-exported by
``runtime_shim`` itself (``from runtime_shim import Sandbox``).

- ``sandbox``     ``Sandbox``: create, exec, files, pack-diff, checkpoint, close; the node's
                  sandbox records (list, remove, sweep)
- ``aio``         ``AsyncSandbox``, the same for asyncio programs
- ``checkpoint``  checkpoints with memory: take, read back, restore
- ``exitwatch``   the watcher that removes a killed process's sandboxes
"""
