"""Build logs bounded on disk (``envbuild.build.buildlog``): head and tail kept past the cap,
oldest logs pruned past the directory's cap."""

from __future__ import annotations

import os
import time

from envbuild.build import buildlog


def test_a_capped_log_keeps_its_head_and_latest_tail(tmp_path):
    path = tmp_path / "a.log"
    with buildlog.CappedLog(path, 1000) as log:
        log.write(b"HEAD" + b"." * 96)
        for i in range(500):
            log.write(b"%05d\n" % i)
            assert path.stat().st_size <= 1000
    data = path.read_bytes()
    assert data.startswith(b"HEAD") and data.endswith(b"00499\n")
    assert data.count(buildlog.TRIM_NOTE) == 1
    assert len(data) <= 1000


def test_trim_leaves_a_log_under_the_cap_alone(tmp_path):
    path = tmp_path / "a.log"
    path.write_bytes(b"x" * 1000)
    buildlog.trim(path, 1000)
    assert path.read_bytes() == b"x" * 1000
    path.write_bytes(b"h" * 500 + b"t" * 1000)
    buildlog.trim(path, 1000)
    assert path.read_bytes() == b"h" * 250 + buildlog.TRIM_NOTE + b"t" * 250


def test_prune_deletes_the_oldest_logs_but_never_young_ones(tmp_path):
    now = time.time()
    for i, age in enumerate([5000, 4000, 3000, 10]):
        p = tmp_path / f"b{i}.log"
        p.write_bytes(b"x" * 100)
        os.utime(p, (now - age, now - age))
    buildlog.prune(tmp_path, cap=150, min_age=3600)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b2.log", "b3.log"]
