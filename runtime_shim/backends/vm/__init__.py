"""The microVM backend: the same locks launched as QEMU microVMs.

``Sandbox.create(lock, ..., backend="microvm")`` starts one; the modules here are its parts:

- ``erofs``      each layer as a read-only EROFS image (once per host) + the writable ext4 disk
- ``kernel``     the guest kernel (Debian's cloud kernel), its boot image and modules
- ``initramfs``  the reproducible initramfs (busybox, modules, agent, init) and the guest init
- ``qemu``       ``VmRequest`` → QEMU argv (pure), the ``VmLauncher`` seam, the KVM probe
- ``backend``    ``MicroVmBackend``, the ``Backend`` (``runtime_shim.backends.base``) the SDK drives, and
                 ``MicroVmSandbox``, its handle of one running VM
"""
