"""The pure parts of runtime_shim.backends.criu: the record's shape, CRIU's log lines made into one
refusal, mount tables compared after a restore."""

from __future__ import annotations

import pytest

from envbuild.errors import CheckpointRefused
from runtime_shim.backends import criu

GOOD = {"version": 1, "kind": "criu", "files": {"pstree.img": {"sha256": "0" * 64, "size": 1}},
        "processes": [{"pid": 1, "ppid": 0, "comm": "envbuild-agent"}],
        "agent_log": "file[7d:c]", "agent_socket": "socket:[3469776]"}


def test_a_record_of_this_version_passes():
    criu.check_record(GOOD)


@pytest.mark.parametrize("change", [
    {"version": 2}, {"kind": "qemu"}, {"files": []}, {"processes": {}},
    {"agent_log": "../../etc/passwd"}, {"agent_socket": "socket:[1]\ninherit-fd fd[0]:x"},
    {"files": {f"f{i}": {} for i in range(criu.MAX_IMAGE_FILES + 1)}},
])
def test_a_malformed_or_foreign_record_is_refused(change):
    with pytest.raises(CheckpointRefused):
        criu.check_record({**GOOD, **change})


def test_refusal_is_one_line_naming_the_process_and_skipping_noise():
    errors = ["rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted",
              "unix: Unix socket 3736759 not found",
              "Dump files (pid: 16216) failed with -1"]
    e = criu._refusal("checkpoint eb-1", errors, [{"pid": 1, "ppid": 0, "comm": "agent"}],
                      "runc exited 1")
    assert e.message == "checkpoint eb-1 (host pid 16216): unix: Unix socket 3736759 not found"
    assert "\n" not in e.message and "RLIMIT" not in e.message
    assert criu._refusal("restore x", [], [], "runc exited 1").message == \
        "restore x: runc exited 1"


def test_restored_masks_of_dev_null_compare_equal_but_other_changes_do_not():
    made = [["/", "overlay"], ["/proc/keys", "tmpfs"], ["/tmp", "ext4"]]
    back = [["/", "overlay"], ["/tmp", "ext4"], ["/proc/keys", "devtmpfs"]]
    assert sorted(criu._comparable(made)) == sorted(criu._comparable(back))
    assert sorted(criu._comparable(made)) != sorted(criu._comparable(
        [["/", "overlay"], ["/proc/keys", "tmpfs"], ["/tmp", "tmpfs"]]))
