"""``envbuild.serve.ports``' routing rules: which requests are port requests (the ``Host``
``get_host`` names, or E2B's proxy headers with a port other than envd's), the ``domain`` a
create returns, which tokens open a sandbox's ports, and which headers never go on."""

from __future__ import annotations

from aiohttp.test_utils import make_mocked_request

from envbuild.serve import ports
from envbuild.serve.sandboxes import Entry


def _request(headers: dict[str, str]):
    return make_mocked_request("GET", "/x", headers=headers)


def test_port_requests_are_named_by_host_or_by_headers():
    assert ports.target(_request({"Host": "8080-iabc123.localhost:49982"})) == ("iabc123", "8080")
    assert ports.target(_request({"Host": "127.0.0.1:49982", "E2b-Sandbox-Id": "iabc",
                                  "E2b-Sandbox-Port": "3000"})) == ("iabc", "3000")
    # envd's own requests, the control plane, other hosts: not port requests
    for headers in ({"Host": "127.0.0.1:49982", "E2b-Sandbox-Id": "iabc",
                     "E2b-Sandbox-Port": "49983"},
                    {"Host": "49983-iabc.localhost:1"}, {"Host": "localhost:49982"},
                    {"Host": "abc-iabc.localhost"}, {"Host": "8080-i/../x.localhost"}):
        assert ports.target(_request(headers)) is None, headers


def test_the_domain_is_localhost_at_the_servers_port():
    assert ports.domain(_request({"Host": "127.0.0.1:41234"})) == "localhost:41234"
    assert ports.domain(_request({"Host": "[::1]"})) == "localhost"


def test_only_the_sandboxs_own_tokens_open_its_ports():
    entry = Entry(id="i1", template="t", sandbox=None, token="envd-token", metadata={},
                  env_vars={}, started_at=0, end_at=0)
    assert entry.traffic_token and entry.traffic_token != entry.token
    ok = ({ports.TRAFFIC_HEADER: entry.traffic_token}, {"X-Access-Token": "envd-token"})
    bad = ({}, {ports.TRAFFIC_HEADER: ""}, {ports.TRAFFIC_HEADER: "envd-token"},
           {"X-Access-Token": entry.traffic_token}, {ports.TRAFFIC_HEADER: entry.traffic_token[:-1]})
    assert all(ports.authorized(_request(h), entry) for h in ok)
    assert not any(ports.authorized(_request(h), entry) for h in bad)


def test_our_headers_and_hop_by_hop_ones_are_not_forwarded():
    forwarded = dict(ports._headers(_request({
        "Host": "8080-i1.localhost", "X-Access-Token": "a", ports.TRAFFIC_HEADER: "b",
        "E2b-Sandbox-Id": "i1", "E2b-Sandbox-Port": "8080", "X-API-KEY": "k",
        "Connection": "keep-alive", "Transfer-Encoding": "chunked", "Cookie": "c=1"})))
    assert forwarded == {"Host": "8080-i1.localhost", "Cookie": "c=1"}
