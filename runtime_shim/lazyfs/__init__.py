"""Lazy layers: each layer served by the kernel from a metadata tree over the node's object
store, its files filled on first access by the node's fanotify filler (docs/lazy-loading.md).

A lazy sandbox (``Sandbox.create(lazy=True)``, ``envbuild run --lazy``) does not wait for its
layers to be pulled and unpacked. Each layer is an overlay of a tree of metadata built from
its TOC (directories, symlinks, modes, owners, xattrs, whiteouts; each regular file an empty
file carrying ``trusted.overlay.metacopy`` and a redirect to its object) over the node's
content-addressed objects (``objects/<sha256>``, a data-only lower layer). An object is a
sparse placeholder until first read; the filler, answering fanotify pre-content events
(Linux >= 6.14), fetches its frames, verifies them against the TOC and writes them before
the reader is let through. No FUSE and no daemon on the read path: lookups, ``stat``,
``readdir`` and reads of complete objects are the kernel's.

Where each concern lives:

==================  ========================================================================
``native``          client side: ``native_layer_dirs`` (what a lazy create calls), the
                    filler's start and socket, ``node ls``/``node gc`` of native layers
``nativetree``      a layer's metadata tree (from ``tree``, ``metatree``, ``metagen``) and
                    its overlay mount
``objects``         the node's object store: placeholders, what is filled, layer records
``filler``          the filler process: its socket (root only), its fanotify group and
                    worker (``fillworker``; ``fillbatch``, ``fillwindow``: what is filled
                    together; ``fanotify``: the syscalls)
``fillhints``       what a sandbox reads next: Python imports (``pydeps``, ``pyindex``,
                    ``pystartup``) and ELF dependencies (``elfdeps``), filled ahead
==================  ========================================================================

Dependencies point one way: ``runtime_shim.node.nodecache`` uses ``native``; nothing here
imports ``nodecache``.
"""

from __future__ import annotations

from envbuild._lazy import lazy_exports

__all__ = ["collect_objects", "describe_native", "describe_objects", "index_layer_file",
           "index_reader"]

# Imported on first use: what the CLI and the build read of native layers and import indexes.
__getattr__, _ = lazy_exports(__name__, {
    "collect_objects": "runtime_shim.lazyfs.objcollect",
    "describe_native": "runtime_shim.lazyfs.native",
    "describe_objects": "runtime_shim.lazyfs.objgc",
    "index_layer_file": "runtime_shim.lazyfs.pyindex",
    "index_reader": "runtime_shim.lazyfs.pyindex",
})
