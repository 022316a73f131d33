"""``envbuild.build.reaper`` without mounts or runc: which dirs it takes (owner gone), which it
leaves (owner alive, no owner file), and that it never follows a symlink."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from envbuild.build.executor import claim_scratch
from envbuild.build.reaper import bundle_container_ids, loops_backed_under, reap_stale_builds


def _dead(builds: Path, name: str) -> Path:
    """A scratch dir whose owner has gone (its owner file exists, nobody holds its lock)."""
    scratch, fd = claim_scratch(builds, name)
    (scratch / "merged").mkdir()
    (scratch / "merged" / "file").write_text("x")
    os.close(fd)
    return scratch


def test_dead_builds_are_reaped_live_ones_and_strangers_are_not(tmp_path):
    builds = tmp_path / "builds"
    dead = _dead(builds, "dead-1")
    live, live_fd = claim_scratch(builds, "live-1")
    (builds / "no-owner").mkdir()  # not made by a builder: never ours
    try:
        got = reap_stale_builds(builds)
        assert [r.name for r in got] == ["dead-1"]
        assert not dead.exists() and not (builds / "dead-1.owner").exists()
        assert live.is_dir() and (builds / "live-1.owner").exists()
        assert (builds / "no-owner").is_dir()
        assert reap_stale_builds(builds) == []
    finally:
        os.close(live_fd)
    assert [r.name for r in reap_stale_builds(builds)] == ["live-1"]  # its owner is gone now


def test_an_owner_file_locked_by_another_open_is_alive(tmp_path):
    builds = tmp_path / "builds"
    dead = _dead(builds, "b")
    fd = os.open(builds / "b.owner", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert reap_stale_builds(builds) == [] and dead.is_dir()
    finally:
        os.close(fd)


def test_a_symlinked_scratch_dir_is_never_followed(tmp_path):
    builds = tmp_path / "builds"
    builds.mkdir()
    victim = tmp_path / "precious"
    (victim / "merged").mkdir(parents=True)
    (victim / "merged" / "keep").write_text("keep")
    (victim / "bundle-1").mkdir()
    (victim / "bundle-1" / "config.json").write_text(
        json.dumps({"linux": {"cgroupsPath": "/envbuild/eb-build-0123456789ab"}}))
    (builds / "evil").symlink_to(victim)
    (builds / "evil.owner").write_text("1\n")
    got = reap_stale_builds(builds)
    assert [(r.name, r.containers) for r in got] == [("evil", ())]
    assert not os.path.lexists(builds / "evil")  # the link only
    assert (victim / "merged" / "keep").read_text() == "keep"


def test_a_symlinked_owner_file_or_builds_dir_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    dead = _dead(elsewhere, "x")
    link = tmp_path / "builds"
    link.symlink_to(elsewhere)
    assert reap_stale_builds(link) == []  # builds/ itself a symlink: not ours
    assert dead.is_dir()
    builds = tmp_path / "real"
    builds.mkdir()
    (builds / "y").mkdir()
    (builds / "y.owner").symlink_to(elsewhere / "x.owner")
    assert reap_stale_builds(builds) == []
    assert (builds / "y").is_dir() and dead.is_dir()


def test_bundle_container_ids_take_only_build_container_ids(tmp_path):
    scratch = tmp_path / "s"
    for i, path in enumerate(["/envbuild/eb-build-abc123", "/envbuild/../../etc",
                              "/other/eb-build-abc", "/envbuild/eb-build-a/b", 7], 1):
        (scratch / f"bundle-{i}").mkdir(parents=True)
        (scratch / f"bundle-{i}" / "config.json").write_text(
            json.dumps({"linux": {"cgroupsPath": path}}))
    (scratch / "bundle-9").mkdir()
    (scratch / "bundle-9" / "config.json").write_text("{not json")
    (tmp_path / "outside.json").write_text(
        json.dumps({"linux": {"cgroupsPath": "/envbuild/eb-build-feed"}}))
    (scratch / "bundle-10").mkdir()
    (scratch / "bundle-10" / "config.json").symlink_to(tmp_path / "outside.json")
    assert bundle_container_ids(scratch) == ["eb-build-abc123"]


def test_no_loop_device_is_backed_by_a_fresh_dir(tmp_path):
    assert loops_backed_under(tmp_path) == []
