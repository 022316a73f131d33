"""The host's side of DETACH and ATTACH (agent protocol 3) against a fake agent: the request
frames, the one-line refusal of an agent that predates them, and the agent's DETACHED and
ATTACHED accepted only where they belong (else ``SandboxCompromised``)."""

from __future__ import annotations

import pytest

from envbuild.errors import RuntimeShimError, SandboxCompromised
from runtime_shim.isolation import agent
from runtime_shim.isolation.agent import frame
from runtime_shim.isolation.agent_session import open_session
from runtime_shim.isolation.agent_wire import R_ATTACHED, R_DETACHED, T_ATTACH, T_DETACH
from tests.unit.test_agent_parser import FakeAgent, exit_frame

V3 = frame(agent.R_HELLO, (3).to_bytes(4, "big") + b"envbuild-agent 3")
DETACHABLE = agent.ExecRequest(argv=("sh",), detachable=True, timeout=5)
ATTACH = agent.ExecRequest(argv=(), attach=7, timeout=5)


def _attached(dropped: int = 0) -> bytes:
    return frame(R_ATTACHED, dropped.to_bytes(8, "big"))


def _drive(fake: FakeAgent, req: agent.ExecRequest, detach: bool = False) -> agent.ExecOutcome:
    session = open_session(lambda: fake.host, req, 1 << 20)
    if detach:
        session.detach()
    try:
        return session.drive_blocking()
    finally:
        fake._stop.set()
        fake._reader.join(5)  # (the session closed its end: the reader sees EOF)
        fake.peer.close()


def test_requests_ask_for_version_3():
    encoded = agent.encode_request(DETACHABLE)
    assert encoded[5:9] == (3).to_bytes(4, "big") and encoded.endswith(frame(agent.T_START))
    assert agent.encode_request(ATTACH) == frame(agent.T_HELLO, (3).to_bytes(4, "big")) + \
        frame(T_ATTACH, (7).to_bytes(4, "big"))
    with pytest.raises(RuntimeShimError, match="not a detach id"):
        agent.encode_request(agent.ExecRequest(argv=(), attach=0))


def test_a_detach_ends_the_session_with_the_id():
    fake = FakeAgent(V3 + frame(agent.R_STDOUT, b"1\n"), frame(R_DETACHED, (9).to_bytes(4, "big")),
                     gap=0.2)  # (DETACHED is accepted only once DETACH went out)
    out = _drive(fake, DETACHABLE, detach=True)
    assert (out.detached, out.stdout) == (9, b"1\n")
    assert frame(T_DETACH) in bytes(fake.received)


def test_an_agent_that_predates_detach_says_so_in_one_line():
    old = frame(agent.R_ERROR, b"unsupported protocol version 3; this agent speaks 1 to 2")
    with pytest.raises(RuntimeShimError) as e:
        _drive(FakeAgent(old), ATTACH)
    assert type(e.value) is RuntimeShimError
    assert e.value.message == ("this sandbox's agent cannot detach or attach a command (it "
                               "speaks protocol 2, detached commands need 3)")


def test_an_attach_reports_what_was_dropped_then_the_command():
    out = _drive(FakeAgent(V3 + _attached(123) + frame(agent.R_STDOUT, b"later\n")
                           + exit_frame(4)), ATTACH)
    assert (out.exit_code, out.stdout, out.detached) == (4, b"later\n", 0)


@pytest.mark.parametrize("answer, req, detach", [
    (V3 + frame(R_DETACHED, (9).to_bytes(4, "big")), DETACHABLE, False),  # not asked
    (V3 + frame(R_DETACHED, (0).to_bytes(4, "big")), DETACHABLE, True),   # id 0
    (V3 + frame(R_DETACHED, b"\0\0\0\1\0"), DETACHABLE, True),             # 5 bytes
    (V3 + _attached(), DETACHABLE, False),                                 # not an attach
    (V3 + frame(agent.R_STDOUT, b"x") + _attached(), ATTACH, False),       # output first
    (V3 + exit_frame(0), ATTACH, False),                                   # EXIT first
    (V3 + _attached() + _attached(), ATTACH, False),                       # twice
    (V3 + frame(R_ATTACHED, b"\0"), ATTACH, False),                        # short
])
def test_detached_and_attached_out_of_place_are_a_compromised_channel(answer, req, detach):
    with pytest.raises(SandboxCompromised):
        _drive(FakeAgent(answer + exit_frame(0)), req, detach)


def test_a_plain_exec_takes_no_version_3_frames():
    with pytest.raises(SandboxCompromised, match="unknown frame 0x87"):
        FakeAgent(frame(agent.R_HELLO, (1).to_bytes(4, "big")) + frame(
            R_DETACHED, (1).to_bytes(4, "big"))).run()
