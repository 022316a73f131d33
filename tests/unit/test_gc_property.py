"""GC never deletes anything reachable: a property test over random ref graphs.

Random layers, random locks sharing them (some snapshot locks naming a parent lock), key
records, refs, job-manifest roots; then random ref deletions and ``gc(grace=0)``. Afterwards
every blob reachable from the remaining roots exists and verifies, and every unreachable blob
(old enough) is gone. Runs on a MemoryStore and a LocalStore.
"""

from __future__ import annotations

import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envbuild.oci import ANNOTATION_PARENT, MEDIA_TYPE_CONFIG, MEDIA_TYPE_LAYER_ZSTD
from envbuild.store import (
    KEY_RECORDS,
    KeyRecord,
    LocalStore,
    MemoryStore,
    digest_bytes,
    get_json,
    put_bytes,
    put_json,
    put_key_record,
    read_bytes,
)
from envbuild.store.gc import gc

OLD = 1_000_000.0  # an mtime long before "now"


def make_lock(store, layers: list[str], *, parent: str | None = None, tag: str = "") -> str:
    """An image manifest over ``layers`` (digests of stored blobs); returns its digest."""
    config = put_json(store, {"rootfs": {"diff_ids": layers}, "tag": tag},
                      media_type=MEDIA_TYPE_CONFIG)
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config.to_oci(),
        "layers": [{"mediaType": MEDIA_TYPE_LAYER_ZSTD, "digest": d,
                    "size": store.stat(d).size} for d in layers],
    }
    if parent:
        manifest["annotations"] = {ANNOTATION_PARENT: parent}
    return put_json(store, manifest).digest


def age_everything(store) -> None:
    """Make every blob and record look old (so grace=0 and grace>0 both consider them)."""
    if isinstance(store, MemoryStore):
        for d in store.blobs:
            store.mtimes[d] = OLD
        for k in store.record_mtimes:
            store.record_mtimes[k] = OLD
        return
    for dirpath, _dirs, files in os.walk(store.root):
        for f in files:
            os.utime(os.path.join(dirpath, f), (OLD, OLD))


def closure(store, roots: list[str]) -> set[str]:
    """Reachable blobs, computed independently of gc: manifests by our own JSON layout."""
    out: set[str] = set()
    stack = list(roots)
    while stack:
        d = stack.pop()
        if d in out or not store.exists(d):
            out.add(d)
            continue
        out.add(d)
        if store.stat(d).size and read_bytes(store, d)[:1] == b"{":
            doc = get_json(store, d)
            if isinstance(doc, dict) and "layers" in doc:
                stack.append(doc["config"]["digest"])
                stack.extend(x["digest"] for x in doc["layers"])
                parent = (doc.get("annotations") or {}).get(ANNOTATION_PARENT)
                if parent:
                    stack.append(parent)
    return out


graphs = st.fixed_dictionaries({
    "n_layers": st.integers(1, 8),
    "locks": st.lists(st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=4),
                                st.one_of(st.none(), st.integers(0, 7))),
                      min_size=1, max_size=6),
    "refs": st.lists(st.integers(0, 5), max_size=6),
    "keyed": st.sets(st.integers(0, 7), max_size=4),
    "job_roots": st.sets(st.integers(0, 5), max_size=2),
    "drop_refs": st.sets(st.integers(0, 5)),
    "drop_cache": st.booleans(),
    "strays": st.integers(0, 3),
})


def run_case(store, g) -> None:
    layers = [put_bytes(store, b"layer %d" % i + os.urandom(4)) for i in range(g["n_layers"])]
    locks: list[str] = []
    for i, (idx, parent) in enumerate(g["locks"]):
        ls = [layers[j % len(layers)] for j in idx]
        p = locks[parent % len(locks)] if parent is not None and locks else None
        locks.append(make_lock(store, ls, parent=p, tag=str(i)))
    ref_names = []
    for n, li in enumerate(g["refs"]):
        name = f"env/e{n}" if n % 2 == 0 else f"snap/s{n}"
        store.put_ref(name, locks[li % len(locks)])
        ref_names.append(name)
    for k in g["keyed"]:
        layer = layers[k % len(layers)]
        put_key_record(store, digest_bytes(b"key %d" % k), KeyRecord(
            layer=layer, toc=digest_bytes(b"toc"), diff_id=digest_bytes(b"diff"),
            size=store.stat(layer).size))
    for s in range(g["strays"]):
        put_bytes(store, b"stray %d" % s + os.urandom(4))
    job_roots = [locks[j % len(locks)] for j in g["job_roots"]]
    for j in g["drop_refs"]:
        if j < len(ref_names):
            store.delete_ref(ref_names[j])
    age_everything(store)

    before = set(store.list())
    records = {n: store.get_record(KEY_RECORDS, n)["layer"]
               for n in store.list_records(KEY_RECORDS)}
    roots = [store.get_ref(n).digest for n in store.list_refs()] + job_roots
    reach_no_cache = closure(store, roots)
    roots_all = roots + list(records.values())
    must_keep = closure(store, roots_all) if not g["drop_cache"] else reach_no_cache

    report = gc(store, grace=0, roots=job_roots, drop_cache=g["drop_cache"])

    after = set(store.list())
    for d in must_keep & before:
        assert d in after, f"gc deleted reachable blob {d}"
        read_bytes(store, d)  # and it verifies
    assert after == before & must_keep, "an unreachable old blob survived"
    assert {i.name for i in report.deleted if i.kind == "blob"} == before - must_keep
    # no key record points at a deleted blob
    for n in store.list_records(KEY_RECORDS):
        assert store.get_record(KEY_RECORDS, n)["layer"] in after
    if g["drop_cache"]:
        kept = set(store.list_records(KEY_RECORDS))
        assert kept == {n for n, layer in records.items() if layer in reach_no_cache}


@settings(max_examples=150, deadline=None)
@given(graphs)
def test_gc_keeps_exactly_the_reachable_blobs_memory(g):
    run_case(MemoryStore(), g)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs)
def test_gc_keeps_exactly_the_reachable_blobs_local(g):
    with tempfile.TemporaryDirectory() as tmp:
        run_case(LocalStore(os.path.join(tmp, "store")), g)


@settings(max_examples=60, deadline=None)
@given(graphs)
def test_dry_run_deletes_nothing(g):
    store = MemoryStore()
    layers = [put_bytes(store, b"l%d" % i) for i in range(g["n_layers"])]
    put_bytes(store, b"garbage")
    if g["keyed"]:
        make_lock(store, layers)
    age_everything(store)
    blobs, records = dict(store.blobs), store.list_records(KEY_RECORDS)
    report = gc(store, grace=0, drop_cache=g["drop_cache"], dry_run=True)
    assert store.blobs == blobs and store.list_records(KEY_RECORDS) == records
    assert any(i.name == digest_bytes(b"garbage") for i in report.deleted)
