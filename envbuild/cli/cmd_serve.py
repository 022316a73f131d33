"""``envbuild serve``: the E2B-compatible server (``envbuild.serve``) over this node's
sandboxes."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from pathlib import Path
from typing import Any

import click

from envbuild.cli.main import App, pass_app
from envbuild.errors import SettingsError


def register(group: click.Group) -> None:
    group.add_command(serve)


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SettingsError(f"--listen {value!r} is not HOST:PORT",
                            hint="e.g. --listen 127.0.0.1:49982 (port 0: any free port)")
    return host.strip("[]") or "127.0.0.1", int(port)


def _limits(memory: str | None, disk: str | None, pids: int | None, nofile: int | None
            ) -> object:
    """runtime_shim's ``Limits`` with the sizes and counts given (None: all defaults)."""
    from envbuild.sizes import parse_size
    from runtime_shim import Limits

    given: dict[str, Any] = {"pids": pids, "nofile": nofile}
    if memory is not None:
        given["memory_bytes"] = parse_size(memory, what="--memory")
    if disk is not None:
        given["disk_bytes"] = parse_size(disk, what="--disk")
    given = {k: v for k, v in given.items() if v is not None}
    return dataclasses.replace(Limits(), **given) if given else None


def _fleet_backend(app: App, address: str, limits: Any, warm: tuple[str, ...]) -> Any:
    """A ``FleetBackend`` on the fleet at ``address`` (its daemons running), its pools warmed."""
    from envbuild.cli.cmd_fleet import connect
    from envbuild.serve.fleet import FleetBackend

    pools: list[tuple[str, int]] = []
    for item in warm:
        env, sep, n = item.rpartition("=")
        if not sep or not env or not n.isdigit():
            raise SettingsError(f"--warm {item!r} is not ENV=N", hint="e.g. --warm python=2")
        pools.append((env, int(n)))
    backend = FleetBackend(connect(app, address), limits=limits)
    for env, count in pools:
        backend.warm(env, count)
    return backend


@click.command()
@click.option("--listen", default="127.0.0.1:49982", show_default=True, metavar="HOST:PORT",
              help="Where to listen (loopback by default; port 0 picks a free one).")
@click.option("--api-keys", "api_keys", type=click.Path(dir_okay=False), required=True,
              metavar="FILE", help="The accepted API keys, one a line, plain or sha256:<hex>.")
@click.option("--max-upload", default="256MiB", show_default=True, metavar="SIZE",
              help="The most bytes one /files upload request may carry.")
@click.option("--on-exit", "on_exit", type=click.Choice(["keep", "kill"]), default="keep",
              show_default=True, help="What a stop (SIGTERM, SIGINT) does to the sandboxes: "
              "leave them to the next envbuild serve on this node dir, or kill them.")
@click.option("--memory", default=None, metavar="SIZE",
              help="Each sandbox's memory limit (default: runtime_shim's Limits).")
@click.option("--disk", default=None, metavar="SIZE",
              help="Each sandbox's disk limit (default: runtime_shim's Limits).")
@click.option("--pids", type=click.IntRange(1), default=None, metavar="N",
              help="Each sandbox's process limit (default: runtime_shim's Limits).")
@click.option("--nofile", type=click.IntRange(1), default=None, metavar="N",
              help="Each sandbox's open-files limit per process (default: runtime_shim's "
                   "Limits; pids x nofile is what admission reserves of fs.file-max).")
@click.option("--fleet", "fleet_address", default=None, metavar="ADDRESS",
              help="Place the sandboxes on the Ray fleet at ADDRESS (auto, HOST:PORT, "
                   "ray://HOST:PORT; its daemons started by `envbuild fleet start`) instead "
                   "of this node.")
@click.option("--warm", multiple=True, metavar="ENV=N",
              help="With --fleet: keep N ready sandboxes of ENV on every node (repeatable).")
@pass_app
def serve(app: App, listen: str, api_keys: str, max_upload: str, on_exit: str,
          memory: str | None, disk: str | None, pids: int | None, nofile: int | None,
          fleet_address: str | None, warm: tuple[str, ...]) -> None:
    """Serve E2B's API: the unmodified e2b SDK runs sandboxes of this store's envs with
    E2B_API_URL and E2B_SANDBOX_URL set to http://HOST:PORT and E2B_API_KEY to a key of FILE.
    Prints the URL once it listens; stops on SIGINT or SIGTERM. Its sandboxes outlive it
    (unless --on-exit kill): the next envbuild serve on this node dir serves them again, from
    the records in NODE_DIR/serve (NODE_DIR/serve-fleet with --fleet)."""
    from envbuild.serve import ApiKeys, NodeBackend, ServeOptions, serve_forever
    from envbuild.sizes import parse_size

    host, port = _listen(listen)
    upload_cap = parse_size(max_upload, what="--max-upload")
    keys = ApiKeys.from_file(api_keys)
    settings, limits = app.settings, _limits(memory, disk, pids, nofile)
    records = Path(settings.node_dir) / "serve"
    if fleet_address is not None:
        backend: Any = _fleet_backend(app, fleet_address, limits, warm)
        records = records.with_name("serve-fleet")
    elif warm:
        raise SettingsError("--warm needs --fleet", hint="warm pools are the fleet's")
    else:
        backend = NodeBackend(store=app.open_store(), node_dir=settings.node_dir,
                              runtime=settings.oci_runtime, limits=limits)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_forever(ServeOptions(backend=backend, api_keys=keys, host=host, port=port,
                                         max_upload=upload_cap,
                                         records=records,
                                         keep_on_exit=on_exit == "keep"),
                            on_ready=lambda url: click.echo(f"envbuild serve: {url}", err=True),
                            stop=stop)

    asyncio.run(main())
