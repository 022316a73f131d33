"""E2B's live network rules: ``PUT /sandboxes/{id}/network`` (the SDK's ``update_network``)
replaces a running sandbox's egress rules with ``Sandbox.set_network`` (E2B's rules mapped as
``envbuild.serve.egress`` says). Needs ``X-API-KEY`` like the rest of the control plane; a
sandbox's rules are changed through its own id only (the firewall of its own network
namespace, ``runtime_shim.isolation.netns``)."""

from __future__ import annotations

from aiohttp import web

from envbuild.errors import EnvbuildError
from envbuild.serve import control
from envbuild.serve.egress import ACCESS, NetworkRefused, e2b_network


async def update_network(request: web.Request) -> web.Response:
    """204 once every packet the sandbox sends obeys the new rules; 400 for rules envbuild
    cannot express or a sandbox created without a network, 404 for an unknown sandbox, 409
    for one that is not running."""
    entry = control.entry_of(request)
    body = await control.json_body(request)
    try:
        network = e2b_network(body, body.get(ACCESS))
    except NetworkRefused as e:
        return control.error(400, e.line())
    if entry.state != "running" or entry.sandbox is None:
        return control.error(409, f"sandbox {entry.id} is {entry.state}, not running")
    try:
        await entry.sandbox.set_network(network)
    except EnvbuildError as e:
        if entry.network is None:  # none at create (or not known since a server restart)
            return control.error(400, f"sandbox {entry.id} has no network to change: create "
                                      "it with allow_internet_access= or network= "
                                      f"({e.message})")
        return control.error(500, f"update network of sandbox {entry.id}: {e.message}")
    entry.network = network
    entry.events.note("sandbox.network", f"network rules set: {network}")
    return web.Response(status=204)


def add_routes(app: web.Application) -> None:
    app.router.add_put("/sandboxes/{sandbox_id}/network", update_network)
