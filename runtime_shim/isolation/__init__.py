"""The isolation layer: the host mechanisms a sandbox is made of, one module each.

The bottom of ``runtime_shim``: it imports nothing of the layers above (``node``,
``backends``, ``sdk``, ``fleet``, ``lazyfs``) and knows no sandbox records, stores or locks.

- ``runc``       the OCI runtime: bundles, ``run``/``create``/``delete``, the containers it lists
- ``spec``       a runtime spec (``config.json``) from limits, mounts and a user (pure)
- ``mount``      overlay and bind mounts, unmounting, what is mounted under a dir
- ``netns``      a sandbox's own network namespace, its egress policy and user-mode NAT
- ``seccomp``    the default syscall filter and checks of a caller's own
- ``scratchfs``  capped scratch disks (a loop-mounted ext4 per sandbox or build step)
- ``cgroupfs``   reading and removing a container's cgroups
- ``cpuclass``   CPU classes (weights, ``SCHED_IDLE`` for builds)
- ``fsaccess``   reading and writing files inside a sandbox root without leaving it
- ``stub``       the bottom lower dir every container gets (mount points, the agent's place)
- ``agent``      the exec agent (PID 1 of a sandbox): its build and its protocol, host side;
                 ``agent/`` holds its C source and the protocol's specification
- ``fncall_ns``  the namespaces each FnCall call runs in
- ``lifecycle``  what becomes of a process's sandboxes when it exits
"""
