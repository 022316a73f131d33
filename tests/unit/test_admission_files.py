"""The overcommitted file table (issue 39, item 3; ``runtime_shim.node.admission``, pure parts):
a sandbox is charged its worst case of open files over ``ENVBUILD_FILES_OVERCOMMIT``, and the
host's real open files must fit the table's budget too."""

from __future__ import annotations

import pytest

from envbuild.errors import SettingsError
from runtime_shim.node.admission import (
    DEFAULT_FILES_OVERCOMMIT,
    BudgetSettings,
    HostTables,
    Reservation,
    node_budget,
    refusal,
    reservation,
)
from runtime_shim.node.model import Limits

GiB = 1 << 30
# a 24 GiB host without disk in the way
HOST = HostTables(file_max=2_466_290, pid_max=4_194_304, threads_max=10 ** 7,
                  disk_free=10 ** 15, disk_size=10 ** 15, files_open=20_000)


def _admitted(budget, one: Reservation) -> tuple[int, str]:
    held, n = Reservation(), 0
    while (refused := refusal(budget, held, n, one, "sandbox")) is None:
        held, n = held + one, n + 1
    return n, refused[0]


def test_a_default_sandbox_is_charged_its_worst_case_over_the_overcommit():
    default = Limits(disk_bytes=None)
    assert reservation(default).files == 256 * 1024  # strict
    assert reservation(default, DEFAULT_FILES_OVERCOMMIT).files == 4096
    assert reservation(Limits(pids=3, nofile=7), 64).files == 1  # rounded up, never 0
    budget = node_budget(HOST, BudgetSettings())
    # strict: the file table binds at 7 default sandboxes; overcommitted: 451
    assert _admitted(budget, reservation(default)) == (7, "files")
    assert _admitted(budget, reservation(default, DEFAULT_FILES_OVERCOMMIT)) == (451, "files")
    # the benchmark's 8 x 64 sandboxes: 3,000 fit with room to spare
    small = reservation(Limits(pids=8, nofile=64, disk_bytes=None), DEFAULT_FILES_OVERCOMMIT)
    assert small.files == 8 and _admitted(budget, small)[0] > 3000


def test_what_the_host_has_open_must_fit_the_table_whatever_the_caps():
    one = Reservation(files=4096)
    full = HostTables(2_466_290, 32768, 32768, 10 ** 12, 10 ** 12,
                      files_open=int(2_466_290 * 0.75) - 4000)
    budget = node_budget(full, BudgetSettings())
    refused = refusal(budget, Reservation(), 0, one, "sandbox eb-1")
    assert refused == ("files_open", "node budget of open files exceeded: sandbox eb-1 needs "
                       "4096, the host has 1845717 open now (fs.file-nr), budget 1849717 "
                       "(75% of fs.file-max 2466290)")
    assert refusal(budget, Reservation(), 0, Reservation(files=4000), "x") is None
    # a cap lowers what sandboxes may reserve, not the table the host's files count against
    capped = node_budget(HOST, BudgetSettings(caps={"files": 1000}))
    assert capped.files_table == int(2_466_290 * 0.75)
    assert refusal(capped, Reservation(), 0, Reservation(files=900), "x") is None
    assert refusal(capped, Reservation(), 0, Reservation(files=1001), "x")[0] == "files"


def test_the_overcommit_from_the_environment():
    assert BudgetSettings.from_env({}).files_overcommit == DEFAULT_FILES_OVERCOMMIT == 64
    assert BudgetSettings.from_env({"ENVBUILD_FILES_OVERCOMMIT": " 1 "}).files_overcommit == 1
    assert BudgetSettings.from_env({"ENVBUILD_FILES_OVERCOMMIT": "2.5"}).files_overcommit == 2.5
    for bad in ("0.5", "0", "-3", "lots", "inf", "nan"):
        with pytest.raises(SettingsError, match="ENVBUILD_FILES_OVERCOMMIT"):
            BudgetSettings.from_env({"ENVBUILD_FILES_OVERCOMMIT": bad})
