"""Job manifests end to end: build the busybox env, resolve and verify a manifest, start a
sandbox from a resolved entry through the SDK, and GC a store with builds, refs and a job."""

from __future__ import annotations

import json

import pytest

from envbuild.jobs import load_job_manifest
from envbuild.store import LocalStore, read_bytes

pytestmark = pytest.mark.integration

JOB = """\
apiVersion: envbuild/v1
kind: JobManifest
name: smoke
groups:
  - name: shell
    lock: busybox-shell
    count: 2
    limits: {pids: 64, memory_bytes: 256MiB, output_bytes: 1MiB, cpus: 0.5, disk_bytes: 64M,
             inodes: 20000, exec_timeout: 30, cpu_class: best-effort}
"""


def test_resolve_verify_run_and_gc(envbuild_cli, tmp_path):
    assert envbuild_cli("build").code == 0
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    result = envbuild_cli("job", "resolve", str(job))
    assert result.code == 0, result.err
    resolved = tmp_path / "job.resolved.yaml"
    manifest = load_job_manifest(resolved)
    (group,) = manifest.groups
    assert group.resolved and group.pinned.ref == "env/busybox-shell"
    # issue 38: every Limits field comes through the manifest, resolved and re-read
    assert (group.limits.cpus, group.limits.disk_bytes, group.limits.inodes,
            group.limits.exec_timeout, group.limits.cpu_class) == (0.5, 64 << 20, 20000, 30,
                                                                    "best-effort")
    assert len(group.pinned.layers) == 3

    result = envbuild_cli("job", "verify", str(resolved), "--json")
    assert result.code == 0, result.out + result.err
    assert result.json()["checked"] == 5

    from envbuild.jobs import create_sandbox

    store = LocalStore(envbuild_cli.store)
    sandboxes = [create_sandbox(group, store=store, node_dir=envbuild_cli.node)
                 for _ in range(group.count)]
    try:
        for sb in sandboxes:
            assert sb.lock.digest == group.lock
            r = sb.exec("cat /sys/fs/cgroup/pids.max 2>/dev/null || echo none; echo $KV_FILE")
            assert r.ok, r.stderr
            assert r.stdout.decode().split()[-1] == "/workspace/.kv"
            assert r.stdout.decode().split()[0] in ("64", "none")
            # the disk limit: the sandbox's /tmp is capped at 64 MiB (a quota-capped subvolume
            # of the node's disk pool, so `df` shows the pool: the cap shows when written to)
            r = sb.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=80 2>&1; echo rc=$?")
            assert b"rc=0" not in r.stdout and (b"quota" in r.stdout or b"space" in r.stdout), \
                r.stdout
            sb.exec("rm -f /tmp/fill")
    finally:
        for sb in sandboxes:
            sb.close()

    # GC right after a build: everything is reachable (refs, key records) or young
    result = envbuild_cli("gc", "--grace", "0", "--json")
    assert result.code == 0, result.err
    assert [d for d in result.json()["deleted"] if d["kind"] == "blob"] == []
    # with the ref gone and the cache dropped, only the job manifest keeps the env
    store.delete_ref("env/busybox-shell")
    result = envbuild_cli("gc", "--grace", "0", "--drop-cache", "--job", str(resolved),
                          "--json")
    assert result.code == 0, result.err
    for digest in manifest.blobs():
        read_bytes(store, digest)
    assert envbuild_cli("job", "verify", str(resolved)).code == 0
    result = envbuild_cli("gc", "--grace", "0", "--drop-cache", "--json")
    gone = {d["name"] for d in json.loads(result.out)["deleted"]}
    assert set(manifest.blobs()) <= gone
    result = envbuild_cli("job", "verify", str(resolved))
    assert result.code == 1 and result.out.count("missing") == 5
