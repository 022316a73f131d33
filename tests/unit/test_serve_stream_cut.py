"""``envbuild serve``'s envd process streams: a listener that falls ``limit`` bytes of output
behind is cut off (its stream ends with an error) and the sandbox's log says so, once; the
other listeners go on."""

from __future__ import annotations

from e2b.envd.process import process_pb as pb
from protobuf import Oneof

from envbuild.serve.envd_process import _BEHIND, _emit, _Listener
from envbuild.serve.events import EventLog
from envbuild.serve.sandboxes import Process


def _data(n: int) -> pb.ProcessEvent:
    return pb.ProcessEvent(event=Oneof("data", pb.ProcessEvent.DataEvent(  # type: ignore[arg-type]
        output=Oneof("pty", b"x" * n))))  # type: ignore[arg-type]


def test_a_listener_past_its_limit_is_cut_and_the_log_says_so():
    proc = Process(pid=7, cmd="yes", args=[], envs={}, cwd=None, tag=None)
    slow, fast = _Listener(100), _Listener(1000)
    proc.listeners += [slow, fast]
    log = EventLog()
    _emit(proc, _data(60), log)
    assert log.select() == []
    _emit(proc, _data(60), log)  # 120 > 100: the slow one is cut
    _emit(proc, _data(60), log)
    assert proc.listeners == [fast] and fast.pending == 180
    assert [slow.get_nowait() for _ in range(slow.qsize())][-1] is _BEHIND
    [event] = log.select()
    assert event.fields == {"event": "process.behind", "pid": "7"}
    assert event.level == "warn" and "fell 100 bytes of output behind" in event.message
