"""``envbuild.serve.lifecycle``: a create body's ``autoPause``/``autoPauseMemory``/
``autoResume`` as the SDK sends them become the policy; anything else is refused in one line."""

from __future__ import annotations

import pytest

from envbuild.serve.lifecycle import Lifecycle, LifecycleRefused


@pytest.mark.parametrize("body, policy", [
    ({}, Lifecycle(timeout=10.0)),
    ({"autoPause": False}, Lifecycle(timeout=10.0)),
    ({"autoPause": True}, Lifecycle(on_timeout="pause", timeout=10.0)),
    ({"autoPause": True, "autoPauseMemory": False},
     Lifecycle(on_timeout="pause", memory=False, timeout=10.0)),
    ({"autoPause": True, "autoResume": {"enabled": True}},
     Lifecycle(on_timeout="pause", auto_resume=True, timeout=10.0)),
    ({"autoPause": False, "autoResume": {"enabled": False}}, Lifecycle(timeout=10.0)),
])
def test_the_sdks_lifecycle_fields_are_the_policy(body, policy):
    assert Lifecycle.from_body(body, 10) == policy


def test_get_reports_e2bs_lifecycle_object():
    assert Lifecycle(on_timeout="pause", auto_resume=True).described() == {
        "onTimeout": "pause", "autoResume": True}


@pytest.mark.parametrize("body", [
    {"autoPause": "pause"}, {"autoPause": None}, {"autoPauseMemory": "full"},
    {"autoResume": True}, {"autoResume": {"enabled": 1}}, {"autoResume": {"policy": "any"}},
    {"autoResume": {"enabled": True}},
    {"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}},
])
def test_unknown_or_contradictory_values_are_refused_in_one_line(body):
    with pytest.raises(LifecycleRefused) as e:
        Lifecycle.from_body(body, 10)
    assert "\n" not in str(e.value)


def test_a_records_lifecycle_round_trips():
    policy = Lifecycle(on_timeout="pause", memory=False, timeout=7.5)
    assert Lifecycle.from_json(policy.to_json()) == policy
