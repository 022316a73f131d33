"""``envbuild serve``'s secrets and bounds, against the real server with real runc sandboxes
(issue 37 item 3): the control plane refuses a missing or wrong API key; a sandbox's access
token opens that sandbox only (envd RPC and ``/files``); an upload or JSON body over its bound
is refused with nothing written; a killed or unknown sandbox is a clean not-found."""

from __future__ import annotations

import contextlib
import hashlib

import httpx
import pytest

from tests.e2b_server import API_KEY, e2b_env, running_server
from tests.integration.conftest import build_busybox_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2bsec")
    store, node = build_busybox_env(root)
    # the key file holds one key hashed (sha256:) and one other key plain
    keys = f"sha256:{hashlib.sha256(API_KEY.encode()).hexdigest()}\nanother-key\n"
    with running_server(root, store.root, node, keys=keys, args=("--max-upload", "1MiB")) as srv:
        yield srv


def _create(server, key: str = API_KEY) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/sandboxes", headers={"X-API-KEY": key},
                      json={"templateID": "busybox-shell", "timeout": 120})


def _envd(server, sandbox_id: str, token: str | None) -> dict[str, str]:
    h = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
    if token is not None:
        h["X-Access-Token"] = token
    return h


def test_control_plane_needs_a_configured_key(server):
    for headers in ({}, {"X-API-KEY": "wrong"}, {"X-API-KEY": API_KEY + "x"},
                    {"X-API-KEY": hashlib.sha256(API_KEY.encode()).hexdigest()}):
        for method, path in (("POST", "/v2/sandboxes"), ("GET", "/v2/sandboxes"),
                             ("GET", "/sandboxes/x"), ("DELETE", "/sandboxes/x"),
                             ("POST", "/sandboxes/x/pause"), ("POST", "/sandboxes/x/resume"),
                             ("POST", "/v2/sandboxes/x/connect"),
                             ("POST", "/sandboxes/x/snapshots"), ("POST", "/sandboxes/x/fork")):
            r = httpx.request(method, f"{server.url}{path}", headers=headers,
                              json={"templateID": "busybox-shell"})
            assert r.status_code == 401, (headers, method, path, r.text)
    # the plain key of the file and the one given as sha256: both open it
    assert httpx.get(f"{server.url}/v2/sandboxes", headers={"X-API-KEY": "another-key"}
                     ).status_code == 200


def test_sdk_with_a_wrong_key_is_an_authentication_error(server):
    from e2b import AuthenticationException, Sandbox

    with e2b_env(server):
        with pytest.raises(AuthenticationException):
            Sandbox.create("busybox-shell", api_key="not-a-key")


def test_a_token_opens_its_own_sandbox_only(server):
    a, b = _create(server).json(), _create(server).json()
    try:
        assert a["envdAccessToken"] != b["envdAccessToken"]
        url = f"{server.url}/filesystem.Filesystem/Stat"
        body = {"path": "/"}
        ok = httpx.post(url, json=body, headers=_envd(server, a["sandboxID"],
                                                       a["envdAccessToken"]))
        assert ok.status_code == 200, ok.text
        for token in (b["envdAccessToken"], None, "", a["envdAccessToken"][:-1]):
            r = httpx.post(url, json=body, headers=_envd(server, a["sandboxID"], token))
            assert r.status_code == 401, (token, r.text)
            r = httpx.get(f"{server.url}/files", params={"path": "/etc/passwd"},
                          headers=_envd(server, a["sandboxID"], token))
            assert r.status_code == 401, (token, r.text)
            r = httpx.post(f"{server.url}/process.Process/List", json={},
                           headers=_envd(server, a["sandboxID"], token))
            assert r.status_code == 401, (token, r.text)
    finally:
        for s in (a, b):
            httpx.delete(f"{server.url}/sandboxes/{s['sandboxID']}",
                         headers={"X-API-KEY": API_KEY})


def test_killed_and_unknown_sandboxes_are_not_found(server):
    from e2b import Sandbox, SandboxNotFoundException

    s = _create(server).json()
    head = {"X-API-KEY": API_KEY}
    assert httpx.delete(f"{server.url}/sandboxes/{s['sandboxID']}", headers=head
                        ).status_code == 204
    for sid in (s["sandboxID"], "nosuchsandbox"):
        assert httpx.get(f"{server.url}/sandboxes/{sid}", headers=head).status_code == 404
        assert httpx.delete(f"{server.url}/sandboxes/{sid}", headers=head).status_code == 404
        for verb in ("timeout", "pause", "resume", "connect", "snapshots", "fork"):
            assert httpx.post(f"{server.url}/sandboxes/{sid}/{verb}", headers=head,
                              json={"timeout": 5}).status_code == 404, verb
        r = httpx.post(f"{server.url}/process.Process/List", json={},
                       headers=_envd(server, sid, s["envdAccessToken"]))
        assert r.status_code == 502 and "was not found" in r.json()["message"]
    with e2b_env(server):
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(s["sandboxID"])
        assert Sandbox.kill(s["sandboxID"]) is False


def test_a_paused_sandbox_is_closed_to_its_token_until_resumed(server):
    """Paused (files only: no CRIU needed), a sandbox's envd and /files answer as for a
    sandbox that does not run, to its own token too; pause and resume are refused where the
    state does not allow them (409), and a bad body is a 400; resumed, the token opens it."""
    s = _create(server).json()
    sid, token = s["sandboxID"], s["envdAccessToken"]
    head = {"X-API-KEY": API_KEY}
    try:
        assert httpx.post(f"{server.url}/sandboxes/{sid}/resume", headers=head,
                          json={}).status_code == 409  # running: nothing to resume
        assert httpx.post(f"{server.url}/sandboxes/{sid}/pause", headers=head,
                          json={"memory": "no"}).status_code == 400
        for bad in ("../escape", "a/b", "", "UPPER", "x" * 200, 7):  # a snapshot's ref name
            assert httpx.post(f"{server.url}/sandboxes/{sid}/snapshots", headers=head,
                              json={"name": bad}).status_code == 400, bad
        for count in (0, 21, "2", True):
            assert httpx.post(f"{server.url}/sandboxes/{sid}/fork", headers=head,
                              json={"count": count}).status_code == 400, count
        assert httpx.post(f"{server.url}/sandboxes/{sid}/pause", headers=head,
                          json={"memory": False}).status_code == 204
        assert httpx.post(f"{server.url}/sandboxes/{sid}/pause", headers=head,
                          json={"memory": False}).status_code == 409
        r = httpx.post(f"{server.url}/process.Process/List", json={},
                       headers=_envd(server, sid, token))
        assert r.status_code == 502, r.text
        r = httpx.get(f"{server.url}/files", params={"path": "/etc/passwd"},
                      headers=_envd(server, sid, token))
        assert r.status_code == 502, r.text
        for verb in ("snapshots", "fork"):  # only a running sandbox is snapshotted or forked
            assert httpx.post(f"{server.url}/sandboxes/{sid}/{verb}", headers=head,
                              json={}).status_code == 409, verb
        r = httpx.post(f"{server.url}/sandboxes/{sid}/resume", headers=head, json={})
        assert r.status_code == 201 and r.json()["envdAccessToken"] == token
        r = httpx.post(f"{server.url}/process.Process/List", json={},
                       headers=_envd(server, sid, token))
        assert r.status_code == 200, r.text
        # killed while paused: gone for good
        assert httpx.post(f"{server.url}/sandboxes/{sid}/pause", headers=head,
                          json={"memory": False}).status_code == 204
        assert httpx.delete(f"{server.url}/sandboxes/{sid}", headers=head).status_code == 204
        for verb in ("resume", "connect"):
            assert httpx.post(f"{server.url}/sandboxes/{sid}/{verb}", headers=head,
                              json={}).status_code == 404
    finally:
        httpx.delete(f"{server.url}/sandboxes/{sid}", headers=head)


def test_oversize_bodies_are_refused(server):
    s = _create(server).json()
    try:
        envd = _envd(server, s["sandboxID"], s["envdAccessToken"])
        # --max-upload 1MiB: announced by its length, or streamed (chunked) past the bound
        r = httpx.post(f"{server.url}/files", params={"path": "/tmp/big"},
                       headers=envd, files={"file": ("big", b"x" * (2 << 20))})
        assert r.status_code == 413, r.text

        def chunks():
            for _ in range(40):
                yield b"y" * (64 << 10)

        boundary = "xyz"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                f"filename=\"big\"\r\n\r\n").encode()

        def multipart():
            yield body
            yield from chunks()
            yield f"\r\n--{boundary}--\r\n".encode()

        r = httpx.post(f"{server.url}/files", params={"path": "/tmp/big"}, content=multipart(),
                       headers={**envd, "Content-Type": f"multipart/form-data; boundary={boundary}"})
        assert r.status_code == 413, r.text
        from e2b import Sandbox

        with e2b_env(server):
            sb = Sandbox.connect(s["sandboxID"])
            with pytest.raises(Exception, match="413|over"):
                sb.files.write("/tmp/big", b"z" * (2 << 20))
            assert not sb.files.exists("/tmp/big")  # nothing of a refused upload is written
            sb.files.write("/tmp/small", b"z" * (512 << 10))  # under the bound: written
            assert len(sb.files.read("/tmp/small", format="bytes")) == 512 << 10
        big = httpx.post(f"{server.url}/v2/sandboxes", headers={"X-API-KEY": API_KEY},
                         json={"templateID": "busybox-shell", "metadata": {"k": "v" * (70 << 10)}})
        assert big.status_code == 413
        rpc = httpx.post(f"{server.url}/filesystem.Filesystem/Stat", headers=envd,
                         json={"path": "/" + "a" * (2 << 20)})
        assert rpc.status_code >= 400
        stat = httpx.post(f"{server.url}/filesystem.Filesystem/Stat", headers=envd,
                          json={"path": "/tmp/big"})
        assert stat.status_code == 404 and "no such file" in stat.text
    finally:
        httpx.delete(f"{server.url}/sandboxes/{s['sandboxID']}", headers={"X-API-KEY": API_KEY})


def _envelope(obj) -> bytes:
    import json

    data = json.dumps(obj).encode()
    return b"\0" + len(data).to_bytes(4, "big") + data


def test_streams_on_one_command_are_bounded(server):
    """Many clients connecting to one command's output: past the bound each further stream is
    refused with resource_exhausted, and the command and server carry on."""
    import json

    from envbuild.serve.envd_process import MAX_LISTENERS

    s = _create(server).json()
    envd = {**_envd(server, s["sandboxID"], s["envdAccessToken"]),
            "Content-Type": "application/connect+json"}
    start = {"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 30"]}}
    try:
        with httpx.Client(timeout=30) as client, contextlib.ExitStack() as streams:
            first = streams.enter_context(client.stream(
                "POST", f"{server.url}/process.Process/Start", headers=envd,
                content=_envelope(start)))
            head = next(first.iter_raw())
            pid = json.loads(head[5:5 + int.from_bytes(head[1:5], "big")])["event"]["start"]["pid"]
            connect = _envelope({"process": {"pid": pid}})
            refused = 0
            for _ in range(MAX_LISTENERS + 3):
                r = streams.enter_context(client.stream(
                    "POST", f"{server.url}/process.Process/Connect", headers=envd,
                    content=connect))
                chunk = next(r.iter_raw())
                if chunk[0] & 2:  # the end-of-stream message: an error
                    assert b"resource_exhausted" in chunk, chunk
                    refused += 1
            assert refused == 4  # the Start stream is one of the MAX_LISTENERS
            listed = httpx.post(f"{server.url}/process.Process/List", json={},
                                headers=_envd(server, s["sandboxID"], s["envdAccessToken"]))
            assert [p["pid"] for p in listed.json()["processes"]] == [pid]
    finally:
        httpx.delete(f"{server.url}/sandboxes/{s['sandboxID']}", headers={"X-API-KEY": API_KEY})


def test_watchers_are_their_sandboxs_own_and_bounded(server):
    """A watcher id opens nothing in another sandbox; a sandbox holds at most MAX_WATCHERS
    watches; a directory the user may not read is refused; killing the sandbox ends them."""
    from envbuild.serve.envd_watch import MAX_WATCHERS

    a, b = _create(server).json(), _create(server).json()
    fs = f"{server.url}/filesystem.Filesystem"
    ha = _envd(server, a["sandboxID"], a["envdAccessToken"])
    hb = _envd(server, b["sandboxID"], b["envdAccessToken"])
    try:
        r = httpx.post(f"{fs}/CreateWatcher", json={"path": "/tmp"}, headers=ha)
        assert r.status_code == 200, r.text
        wid = r.json()["watcherId"]
        assert httpx.post(f"{fs}/GetWatcherEvents", json={"watcherId": wid},
                          headers=ha).status_code == 200
        for verb in ("GetWatcherEvents", "RemoveWatcher"):
            r = httpx.post(f"{fs}/{verb}", json={"watcherId": wid}, headers=hb)
            assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
            r = httpx.post(f"{fs}/{verb}", json={"watcherId": wid},
                           headers=_envd(server, a["sandboxID"], b["envdAccessToken"]))
            assert r.status_code == 401, r.text
        for _ in range(MAX_WATCHERS - 1):
            assert httpx.post(f"{fs}/CreateWatcher", json={"path": "/tmp"},
                              headers=ha).status_code == 200
        r = httpx.post(f"{fs}/CreateWatcher", json={"path": "/tmp"}, headers=ha)
        assert r.json()["code"] == "resource_exhausted", r.text
        assert httpx.post(f"{fs}/CreateWatcher", json={"path": "/tmp"},
                          headers=hb).status_code == 200  # another sandbox's are its own
        httpx.post(f"{server.url}/process.Process/Start", headers={
            **hb, "Content-Type": "application/connect+json"},
            content=_envelope({"process": {"cmd": "/bin/sh", "args": [
                "-c", "mkdir -p /private && chmod 700 /private"]}}))
        agent = {**hb, "Authorization": "Basic " + __import__("base64").b64encode(
            b"agent:").decode()}
        r = httpx.post(f"{fs}/CreateWatcher", json={"path": "/private"}, headers=agent)
        assert r.json()["code"] == "permission_denied", r.text
    finally:
        for s in (a, b):
            httpx.delete(f"{server.url}/sandboxes/{s['sandboxID']}",
                         headers={"X-API-KEY": API_KEY})
    r = httpx.post(f"{fs}/GetWatcherEvents", json={"watcherId": wid}, headers=ha)
    assert r.status_code == 502  # the sandbox is gone, and its watches with it
