"""JobManifest files: schema errors with FILE:LINE:COL and hints, JSON too, and the model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from envbuild.jobs import JobManifestError, load_job_manifest, parse_job_manifest
from envbuild.jobs.model import SandboxGroup, limits_from_mapping, limits_to_mapping
from runtime_shim.backends import backend_names
from runtime_shim.isolation import cpuclass
from runtime_shim.sdk.sandbox import Limits
from tests.unit.test_jobs_support import MANIFEST


def problems(text: str, name: str = "jobs.yaml") -> list[str]:
    with pytest.raises(JobManifestError) as e:
        parse_job_manifest(text, name)
    assert e.value.render_lines()[-1].startswith("error: ")
    return [p.render() for p in e.value.problems]


def test_valid_manifest_loads_with_defaults(tmp_path):
    (tmp_path / "jobs.yaml").write_text(MANIFEST)
    m = load_job_manifest(tmp_path / "jobs.yaml")
    swe, tools = m.groups
    assert (m.name, swe.name, swe.lock, swe.count, swe.backend) == (
        "batch-7", "swe", "env/alpha", 4, "container")
    assert swe.limits == Limits(pids=64, memory_bytes=1 << 30)
    assert (tools.count, tools.backend, tools.network) == (1, "microvm", True)
    assert not m.resolved and m.blobs() == []


def test_errors_name_file_line_column_and_hint():
    text = MANIFEST.replace("count: 4", "count: 0").replace("backend: microvm",
                                                            "backend: microvn")
    text = text.replace("pids: 64}", "pids: 64, nofle: 3}").replace("network: true",
                                                                   "network: yes please")
    got = problems(text)
    assert got == [
        "jobs.yaml:7:12: count: 0 is less than the minimum of 1 (at groups[0].count)",
        "jobs.yaml:8:38: unknown key 'nofle' (at groups[0].limits.nofle) — did you mean "
        "'nofile'?",
        "jobs.yaml:11:14: backend: unknown sandbox backend 'microvn' (at groups[1].backend) "
        "— did you mean 'microvm'?",
        "jobs.yaml:12:14: network: expected true or false, got a string (at groups[1].network)",
    ]


def test_header_missing_groups_and_bad_lock():
    got = problems("apiVersion: envbuild/v2\nkind: Env\nname: x\n")
    assert ("jobs.yaml:1:13: unsupported apiVersion 'envbuild/v2' (at apiVersion) — use "
            "apiVersion: envbuild/v1") in got
    assert ("jobs.yaml:2:7: not a job manifest: kind 'Env' (at kind) — use kind: JobManifest"
            in got)
    assert any("missing required key 'groups'" in p and "a JobManifest needs" in p for p in got)
    got = problems(MANIFEST.replace("lock: beta", "lock: sha256:abc"))
    assert got == ["jobs.yaml:10:11: lock: 'sha256:abc' is not a valid lock (at groups[1].lock) "
                   "— a lock is a digest (sha256: and 64 lowercase hex digits) or a ref: an env "
                   "name, env/NAME or snap/NAME"]


def test_duplicate_group_names_and_unknown_keys():
    got = problems(MANIFEST.replace("name: tools", "name: swe").replace("count: 4", "cuont: 4"))
    assert got == [
        "jobs.yaml:7:5: unknown key 'cuont' (at groups[0].cuont) — did you mean 'count'?",
        "jobs.yaml:9:11: duplicate group name 'swe' (at groups[1].name) — it is already used "
        "on line 5",
    ]


def test_json_manifest_errors_have_positions_too(tmp_path):
    doc = {"apiVersion": "envbuild/v1", "kind": "JobManifest",
           "groups": [{"lock": "env/a", "limits": {"memory": "lots"}}]}
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(doc, indent=2))
    with pytest.raises(JobManifestError) as e:
        load_job_manifest(path)
    (p,) = e.value.problems
    assert (p.line, p.path) == (8, "groups[0].limits.memory")
    assert "size" in p.render()


@pytest.mark.parametrize("text, needle", [
    ("", "empty file"),
    ("- a\n- b\n", "must be a mapping, got a list"),
    (MANIFEST + "---\n" + MANIFEST, "holds one document"),
    ("apiVersion: [\n", "invalid yaml"),
    (MANIFEST.replace("name: batch-7", "name: batch-7\nname: again"), "duplicate key 'name'"),
])
def test_file_level_problems(text, needle):
    assert needle in problems(text)[0]


def test_unreadable_file(tmp_path):
    with pytest.raises(JobManifestError, match="1 problem in job manifest") as e:
        load_job_manifest(tmp_path / "nope.yaml")
    assert "read job manifest" in e.value.problems[0].message


def test_limits_are_the_sdks_limits_with_its_defaults():
    assert limits_from_mapping({}) == Limits() == SandboxGroup(lock="env/a").sandbox_limits()
    # a None that got past the schema is the default, never "no limit" (issue 34, item 7)
    assert limits_from_mapping({"memory_bytes": None, "pids": None}) == Limits()
    assert limits_from_mapping({"memory": "2G"}) == Limits(memory_bytes=2 << 30)  # the old name


def test_every_limit_is_settable_and_round_trips():
    """Issue 38: a manifest could set 4 of Limits' fields; now every one, by the SDK's names."""
    every = {"pids": 7, "memory_bytes": "3GiB", "nofile": 99, "cpus": 1.5,
             "output_bytes": "1 MB", "exec_timeout": 30, "disk_bytes": "1.5G", "inodes": 5000,
             "cpu_class": "best-effort", "inotify": True}
    assert set(every) == {f.name for f in dataclasses.fields(Limits)}
    text = MANIFEST.replace("limits: {memory: 1GiB, pids: 64}", f"limits: {json.dumps(every)}")
    swe = parse_job_manifest(text).groups[0]
    want = Limits(pids=7, memory_bytes=3 << 30, nofile=99, cpus=1.5, output_bytes=1 << 20,
                  exec_timeout=30, disk_bytes=int(1.5 * (1 << 30)), inodes=5000,
                  cpu_class="best-effort", inotify=True)
    assert swe.limits == want and swe.sandbox_options()["limits"] == want
    written = swe.to_mapping()["limits"]
    assert written == {**limits_to_mapping(want), "memory_bytes": "3GiB", "output_bytes": "1MiB",
                       "disk_bytes": "1536MiB"}
    again = SandboxGroup.from_mapping(swe.to_mapping())
    assert again == swe


def test_cpus_left_out_stays_each_nodes_default():
    swe = parse_job_manifest(MANIFEST).groups[0]
    assert swe.node_cpus and "cpus" not in swe.to_mapping()["limits"]
    assert swe.sandbox_limits().cpus == Limits().cpus
    # a group made in code means what its Limits say
    group = SandboxGroup(lock="env/a", limits=Limits(cpus=3.0))
    assert group.sandbox_limits().cpus == 3.0 and group.to_mapping()["limits"]["cpus"] == 3.0


def test_every_registered_backend_is_accepted_and_one_error_lists_them():
    """Issue 38: the schema listed container and microvm, so a manifest could not pick fncall."""
    for name in backend_names():
        m = parse_job_manifest(MANIFEST.replace("backend: microvm", f"backend: {name}"))
        assert m.groups[1].backend == name
    (line,) = problems(MANIFEST.replace("backend: microvm", "backend: teleport"))
    assert "unknown sandbox backend 'teleport'" in line
    assert f"choose one of: {', '.join(backend_names())}" in line and "fncall" in line


def test_bad_sizes_and_two_names_for_memory_are_one_line_each():
    got = problems(MANIFEST.replace("limits: {memory: 1GiB, pids: 64}",
                                    "limits: {memory: 1GiB, memory_bytes: 2G, disk_bytes: 2XB}"))
    assert got == [
        "jobs.yaml:8:22: memory and memory_bytes are one limit (at groups[0].limits.memory) — "
        "keep memory_bytes (the SDK's name)",
        "jobs.yaml:8:58: disk_bytes: '2XB' is not a size (at groups[0].limits.disk_bytes) — "
        "write bytes or a number with a unit, e.g. 512M, 2GiB, 1.5G (powers of 1024)",
    ]


def test_the_schema_cpu_classes_are_the_runtimes():
    schema = json.loads((Path(__file__).parents[2] / "envbuild/defs/schema/jobmanifest.json")
                        .read_text())
    assert schema["$defs"]["limits"]["properties"]["cpu_class"]["enum"] == [
        cpuclass.LATENCY, cpuclass.BEST_EFFORT]


def test_null_limits_and_huge_counts_are_refused():
    """Issue 34, item 7: ``limits: {pids: null, memory: null}`` and ``count: 10^21`` loaded
    without a word (no limit at all, a count no node can start): now one line each."""
    text = MANIFEST.replace("pids: 64}", "pids: null, nofile: null}").replace(
        "count: 4", "count: 1000000000000000000000").replace("memory: 1GiB", "memory: null")
    got = problems(text)
    assert len(got) == 4, got
    assert "(at groups[0].count)" in got[0] and "maximum of 100000" in got[0], got
    for key in ("memory", "nofile", "pids"):
        (line,) = [p for p in got if f"(at groups[0].limits.{key})" in p]
        assert "got nothing" in line and "remove the key" in line, got
