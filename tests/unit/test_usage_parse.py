"""``runtime_shim.node.usage``'s parsers: cgroup v1 and v2 CPU and limit files as the kernel
writes them (values copied from this host's v1 hierarchy and a v2 host's files)."""

from __future__ import annotations

import pytest

from runtime_shim.node.reclaim import parse_cpu_ns
from runtime_shim.node.usage import parse_limit


def test_cpu_time_from_v1_and_v2():
    assert parse_cpu_ns("1234567890\n", "cpuacct.usage") == 1234567890
    v2 = "usage_usec 2500\nuser_usec 2000\nsystem_usec 500\nnr_periods 0\n"
    assert parse_cpu_ns(v2, "cpu.stat") == 2_500_000
    assert parse_cpu_ns("user_usec 1\n", "cpu.stat") is None  # no usage line: none


@pytest.mark.parametrize(("text", "expected"), [
    ("268435456\n", 268435456),
    ("max\n", None),                        # v2: no limit
    ("9223372036854771712\n", None),        # v1: LLONG_MAX rounded to a page
    ("256\n", 256),                          # pids.max
    ("0\n", 0),
])
def test_limits(text, expected):
    assert parse_limit(text) == expected


def test_a_garbled_file_is_an_error_not_a_figure():
    with pytest.raises(ValueError):
        parse_limit("lots\n")
