"""Native lazy layers: what a layer's first sight on a node prepares, so that the creates
after it cost what a create over unpacked layers does (issue 36's "create after first
sight"). Real kernel, real filler, real runc sandboxes."""

from __future__ import annotations

import hashlib
import os
import time

from envbuild.layers import LayerReader
from runtime_shim.lazyfs import native
from runtime_shim.lazyfs.objects import ObjectStore
from runtime_shim.sdk.sandbox import Sandbox
from tests.integration.test_lazy_native import _env, _SlowRanges, node_dir  # noqa: F401

PASSWD = b"root:x:0:0:root:/root:/bin/sh\n"
GROUP = b"root:x:0:\n"


def test_a_first_sight_fills_what_a_start_reads_without_reading_a_toc_again(
        tmp_path, node_dir):  # noqa: F811  (fixture)
    """The create that first sees a layer hands the filler the layer's TOC as it fetched
    it (the filler reads no TOC over the link), and the filler fills the files every
    sandbox's start reads (``/etc/passwd``, ``/etc/group``) as soon as it has placed the
    layer: here every read of the layers' TOCs through the filler's link takes 3 s, and
    both files are filled well before that, ahead of any create."""
    files = {"etc/passwd": PASSWD, "etc/group": GROUP, "zz/pad.bin": os.urandom(3 << 20)}
    local, layers = _env(tmp_path, "sight", files)
    slow = _SlowRanges(delay=3.0)
    for x in layers:
        with LayerReader.open_file(local.blob_path(x.digest)) as r:
            slow.slow[x.digest] = (r.footer.toc_offset, x.size)
    objects = ObjectStore(node_dir / "node")

    def complete(data: bytes) -> bool:
        return objects.complete(hashlib.sha256(data).hexdigest())
    try:
        store = slow.store(local)
        native.native_layer_dirs(str(node_dir / "node"), store, layers)
        deadline = time.monotonic() + 2.0
        while not (complete(PASSWD) and complete(GROUP)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert complete(PASSWD) and complete(GROUP), "the start's files are not filled"
        with Sandbox.create("sight", store=store, node_dir=node_dir, lazy="native") as sb:
            assert sb.exec("cat /etc/passwd").stdout == PASSWD
        assert not [(a, e) for d, a, e in slow.requests
                    if a < slow.slow[d][1] and e >= slow.slow[d][0]], "a TOC read again"
    finally:
        slow.close()


def test_a_create_over_mounted_layers_is_one_round_trip_to_the_filler(
        tmp_path, node_dir, monkeypatch):  # noqa: F811  (fixture)
    """Once a node has mounted a lock's layers, a create asks its filler one thing (the
    stack its predictions resolve in), which also tells that the filler lives; no ping
    first, no request to the store."""
    store, layers = _env(tmp_path, "again", {"etc/passwd": PASSWD, "etc/group": GROUP})
    root = str(node_dir / "node")
    first = native.native_layer_dirs(root, store, layers)
    sent: list[str] = []
    real = native.filler_request

    def counted(node_root: str, req: dict, timeout: float = 30.0) -> dict | None:
        sent.append(str(req.get("op")))
        return real(node_root, req, timeout)
    monkeypatch.setattr(native, "filler_request", counted)

    class NoStore:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"the store was asked for {name}")
    assert native.native_layer_dirs(root, NoStore(), layers) == first
    assert sent == ["stack"]
    with Sandbox.create("again", store=store, node_dir=node_dir, lazy="native") as sb:
        assert sb.exec("cat /etc/group").stdout == GROUP
    assert sent == ["stack", "stack"]


def test_a_window_follows_the_open_of_a_script_not_of_a_data_file(
        tmp_path, node_dir):  # noqa: F811  (fixture)
    """The files after an opened file in the blob (its fill window) are filled ahead only
    after the open of a Python module or a script (``#!``); after a data file's open they
    stay placeholders until something opens them (in a cold run most of such a window was
    never read: ``fillwindow``)."""
    files = {"a/data.bin": os.urandom(3000),
             **{f"a/n{i:02}.txt": os.urandom(2000) for i in range(10)},
             "b/run": b"#!/bin/sh\necho run\n",
             **{f"b/x{i:02}.txt": os.urandom(2000) for i in range(10)}}
    store, _ = _env(tmp_path, "win2", files)
    objects = ObjectStore(node_dir / "node")

    def complete(rel: str) -> bool:
        return objects.complete(hashlib.sha256(files[rel]).hexdigest())
    with Sandbox.create("win2", store=store, node_dir=node_dir, lazy="native") as sb:
        assert sb.exec("cat /a/data.bin >/dev/null").exit_code == 0
        assert sb.exec("cat /b/run >/dev/null").exit_code == 0
        deadline = time.monotonic() + 10
        while not all(complete(f"b/x{i:02}.txt") for i in range(10)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(complete(f"b/x{i:02}.txt") for i in range(10)), "no window after a script"
        time.sleep(0.5)
        assert complete("a/data.bin") and not any(complete(f"a/n{i:02}.txt")
                                                  for i in range(10))
        got = sb.exec("cat /a/n03.txt | sha256sum").stdout.decode().split()[0]
        assert got == hashlib.sha256(files["a/n03.txt"]).hexdigest()
