"""Conformance, metrics and logs: the unmodified ``e2b`` SDK's ``get_metrics`` (sync and async)
against ``envbuild serve`` reports a real runc sandbox's CPU, memory and disk as they change;
its logs (E2B's ``/v2/sandboxes/{id}/logs`` and ``/sandboxes/{id}/logs``, read into the SDK's
own response models) hold the server's events for that sandbox and the commands it ran, never
their environment."""

from __future__ import annotations

import asyncio
import datetime
import time

import httpx
import pytest

from tests.e2b_server import API_KEY

pytestmark = pytest.mark.slow
TEMPLATE = "busybox-shell"
MiB = 1 << 20


def test_metrics_follow_cpu_memory_and_disk(e2b_server):
    from e2b import Sandbox, SandboxNotFoundException

    sb = Sandbox.create(TEMPLATE, timeout=120)
    try:
        sb.commands.run("end=$(( $(date +%s) + 4 )); while [ $(date +%s) -lt $end ]; do :; "
                        "done", background=True)
        time.sleep(0.5)
        first = sb.get_metrics()
        assert first, "no sample"
        m = first[-1]
        assert m.cpu_count >= 1 and m.cpu_used_pct > 10, first  # the busy loop
        assert 0 < m.mem_used <= m.mem_total and 0 <= m.mem_cache <= m.mem_used
        assert 0 <= m.disk_used < m.disk_total
        assert abs(m.timestamp.timestamp() - time.time()) < 30
        sb.commands.run("dd if=/dev/zero of=/blob bs=1M count=16 2>/dev/null; sync")
        time.sleep(1.2)
        later = sb.get_metrics()
        assert later[-1].disk_used - m.disk_used >= 12 * MiB, (m, later[-1])
        assert len(later) > len(first)
        future = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
        assert sb.get_metrics(start=future) == []
        # the newest sample of several sandboxes at once (E2B's /sandboxes/metrics)
        from e2b.api.client.models import SandboxesWithMetrics

        r = httpx.get(f"{e2b_server.url}/sandboxes/metrics", headers={"X-API-KEY": API_KEY},
                      params={"sandbox_ids": f"{sb.sandbox_id},inope"})
        many = SandboxesWithMetrics.from_dict(r.json()).sandboxes
        assert list(many) == [sb.sandbox_id] and many[sb.sandbox_id]["memUsed"] > 0
    finally:
        sb.kill()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_metrics(sb.sandbox_id)


def test_async_get_metrics(e2b_server):
    from e2b import AsyncSandbox

    async def main() -> list:
        sb = await AsyncSandbox.create(TEMPLATE, timeout=120)
        try:
            return await sb.get_metrics()
        finally:
            await sb.kill()

    got = asyncio.run(main())
    assert got and got[-1].mem_used > 0


def test_logs_hold_the_servers_events_and_commands(e2b_server):
    from e2b import CommandExitException, Sandbox
    from e2b.api.client.models import SandboxLogs, SandboxLogsV2Response

    sb = Sandbox.create(TEMPLATE, timeout=120)
    try:
        sb.commands.run("echo hi", envs={"SECRET_TOKEN": "s3cr3t-value"})
        with pytest.raises(CommandExitException):
            sb.commands.run("exit 3")
        headers = {"X-API-KEY": API_KEY}
        r = httpx.get(f"{e2b_server.url}/v2/sandboxes/{sb.sandbox_id}/logs", headers=headers)
        entries = SandboxLogsV2Response.from_dict(r.json()).logs
        messages = [e.message for e in entries]
        assert messages[0] == f"created from {TEMPLATE}", messages
        assert any("started:" in m and "echo hi" in m for m in messages), messages
        assert any(m.endswith("ended: exit status 3") for m in messages), messages
        assert "s3cr3t-value" not in r.text
        kinds = [e.fields.additional_properties["event"] for e in entries]
        assert kinds[:2] == ["sandbox.create", "process.start"]
        # newest first, and a search
        r = httpx.get(f"{e2b_server.url}/v2/sandboxes/{sb.sandbox_id}/logs", headers=headers,
                      params={"direction": "backward", "limit": 1})
        assert [e.message for e in SandboxLogsV2Response.from_dict(r.json()).logs] == \
            [messages[-1]]
        r = httpx.get(f"{e2b_server.url}/v2/sandboxes/{sb.sandbox_id}/logs", headers=headers,
                      params={"search": "exit status 3"})
        assert len(SandboxLogsV2Response.from_dict(r.json()).logs) == 1
        # v1: a start after everything gives nothing
        r = httpx.get(f"{e2b_server.url}/sandboxes/{sb.sandbox_id}/logs", headers=headers)
        assert [x.line for x in SandboxLogs.from_dict(r.json()).logs] == messages
        r = httpx.get(f"{e2b_server.url}/sandboxes/{sb.sandbox_id}/logs", headers=headers,
                      params={"start": int(time.time() * 1000) + 60_000})
        assert SandboxLogs.from_dict(r.json()).logs == []
        assert httpx.get(f"{e2b_server.url}/sandboxes/{sb.sandbox_id}/logs").status_code == 401
    finally:
        sb.kill()
    r = httpx.get(f"{e2b_server.url}/v2/sandboxes/{sb.sandbox_id}/logs",
                  headers={"X-API-KEY": API_KEY})
    assert r.status_code == 404
