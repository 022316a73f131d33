"""JobManifest files: schema errors with FILE:LINE:COL and hints, JSON too, and the model."""

from __future__ import annotations

import json

import pytest

from envbuild.jobs import JobManifestError, load_job_manifest, parse_job_manifest
from envbuild.jobs.model import GroupLimits, format_size, parse_size
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
    assert swe.limits == GroupLimits(pids=64, memory=1 << 30)
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
        "jobs.yaml:11:14: backend: expected one of 'container', 'microvm', got 'microvn' "
        "(at groups[1].backend) — did you mean 'microvm'?",
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


def test_sizes_and_limits_agree_with_the_sandbox_defaults():
    assert GroupLimits().to_limits() == Limits()
    assert parse_size("2GiB") == parse_size("2G") == parse_size(2 << 30) == 2 << 30
    assert format_size(2 << 30) == "2GiB" and format_size(1000) == 1000
    # a None that got past the schema is the default, never "no limit" (issue 34, item 7)
    assert GroupLimits.from_mapping({"memory": None, "pids": None}).to_limits() == Limits()


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
