"""Issue 34 item 7, build logs: a build's output is untrusted and its log is a host file
outside every capped disk. One build's log holds at most ``BUILD_LOG_CAP`` (its head and its
tail: what ran, and why it failed), and ``envbuild gc`` collects the logs of builds no key
record references once they are older than the grace period. Real builds with runc, the real
CLI."""

from __future__ import annotations

import os
import time

from envbuild.build import buildlog
from envbuild.build.executor import BUILD_LOG_CAP

MiB = 1 << 20

# Two steps of 40 MB each (each under the old 64 MiB per-step cap: 80 MB for the build), then
# the line that says why it failed.
CHATTY = """\
apiVersion: envbuild/v1
kind: Toolkit
name: chatty
description: steps that print a lot, then fail
build_on: busybox-tiny
requires: {abi: [busybox-amd64]}
prefix: /opt/toolkits/chatty
steps:
  - run: yes first-step | head -c 40000000
    network: none
  - run: yes second-step | head -c 40000000
    network: none
  - run: echo THE-REASON-IT-FAILED; exit 3
    network: none
"""


def test_one_build_log_keeps_head_and_tail_within_the_cap(envbuild_cli):
    (envbuild_cli.defs / "toolkits" / "chatty.yaml").write_text(CHATTY)
    r = envbuild_cli("build", "chatty")
    assert r.code == 1 and "exited 3" in r.err, r.err
    (log,) = (envbuild_cli.store / "logs").glob("chatty-*.log")
    assert log.stat().st_size <= BUILD_LOG_CAP  # was 80 MB
    text = log.read_bytes()
    assert text.startswith(b"=== chatty: step 1/3") and b"first-step" in text[:4096]
    assert b"THE-REASON-IT-FAILED" in text[-4096:]
    assert text.count(buildlog.TRIM_NOTE) == 1


def test_gc_collects_old_logs_of_builds_no_key_record_references(envbuild_cli):
    assert envbuild_cli("build").code == 0
    logs = envbuild_cli.store / "logs"
    built = sorted(logs.glob("*.log"))
    assert built  # the layers' own logs: their key records reference them
    gone = logs / "failed-0123456789ab.log"  # a build that never got a key record
    gone.write_bytes(b"x" * 1000)
    young = logs / "running-ba9876543210.log"  # one still being written
    young.write_bytes(b"y")
    two_days_ago = time.time() - 2 * 86400
    for p in [*built, gone]:
        os.utime(p, (two_days_ago, two_days_ago))
    r = envbuild_cli("gc", "--grace", "1h")
    assert r.code == 0, r.err
    assert not gone.exists()
    assert young.exists() and all(p.exists() for p in built)
    assert "deleted log logs/failed-0123456789ab.log 1000 bytes" in r.out
