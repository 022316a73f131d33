"""The microVM backend: the same locks launched as QEMU microVMs.

``Sandbox.create(lock, ..., backend="microvm")`` starts one; the modules here are its parts:

- ``erofs``      each layer as a read-only EROFS image (once per host) + the writable ext4 disk
- ``kernel``     the guest kernel (Debian's cloud kernel), its boot image and modules
- ``initramfs``  the reproducible initramfs (busybox, modules, agent, init) and the guest init
- ``qemu``       ``VmRequest`` → QEMU argv (pure), the ``VmLauncher`` seam, the KVM probe
- ``plan``       what one VM is made of, as data: options, layer transport, config disk, drives,
                 devices, the ``VmRequest`` and its device model
- ``sandbox``    ``MicroVmSandbox``, the handle of one running VM: boot, exec, files, pack-diff,
                 checkpoints
- ``backend``    ``MicroVmBackend``, the ``Backend`` (``runtime_shim.backends.base``) the SDK drives
"""
