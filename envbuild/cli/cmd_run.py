"""``envbuild run``, ``envbuild check`` and ``envbuild sandbox ls|rm|gc``."""

from __future__ import annotations

import json
import sys
import time

import click

from envbuild.cli.main import App, pass_app


def register(group: click.Group) -> None:
    @group.command(context_settings={"ignore_unknown_options": True})
    @click.argument("target")
    @click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
    @click.option("--network", is_flag=True,
                  help="Give the sandbox egress to the public internet through its own NATed "
                       "network namespace (the host and private ranges stay unreachable).")
    @click.option("--allow", "allow", multiple=True, metavar="CIDR[:PORT]|public",
                  help="With --network (implied): egress only to these destinations, private "
                       "ones included, and to the public internet with 'public' (repeatable; "
                       "DNS is always allowed).")
    @click.option("--keep", is_flag=True, help="Leave the sandbox running; print its id.")
    @click.option("--timeout", type=float, default=None, help="Kill CMD after this many seconds.")
    @click.option("--lazy", is_flag=True,  # lazy mode (runtime_shim.lazyfs)
                  help="Start at once: serve the layers from the store with FUSE, fetching "
                       "each file on first read, instead of pulling and unpacking them.")
    @click.option("--backend", type=click.Choice(["container", "microvm"]), default="container",
                  show_default=True, help="Run as an OCI container or a QEMU microVM.")
    @pass_app
    def run(app: App, target: str, cmd: tuple[str, ...], network: bool, allow: tuple[str, ...],
            keep: bool, timeout: float | None, lazy: bool, backend: str) -> int:
        """Run CMD in a fresh sandbox of TARGET (env name, ref or lock digest); builds nothing."""
        from runtime_shim.sdk.sandbox import Sandbox

        # keep with a microVM: refused by the backend itself (BackendUnavailable)
        sb = Sandbox.create(target, store=app.open_store(), node_dir=app.settings.node_dir,
                            backend=backend, network=list(allow) if allow else network,
                            runtime=app.settings.oci_runtime,
                            keep=keep, lazy=lazy)
        try:
            result = sb.exec(list(cmd), timeout=timeout)
        finally:
            if not keep:
                sb.close()
        sys.stdout.buffer.write(result.stdout)
        sys.stdout.flush()
        sys.stderr.buffer.write(result.stderr)
        if result.timed_out:
            click.echo(f"envbuild: command timed out after {timeout}s", err=True)
        if keep:
            click.echo(f"sandbox {sb.id} kept; remove it with `envbuild sandbox rm {sb.id}`",
                       err=True)
        return result.exit_code

    @group.command()
    @click.argument("envs", nargs=-1)
    @click.option("--jobs", "-j", type=click.IntRange(1, 64), default=1, show_default=True,
                  help="Envs checked at once, each in its own sandbox.")
    @pass_app
    def check(app: App, envs: tuple[str, ...], jobs: int) -> int:
        """Run each env's workspace checks in a sandbox over its lock.

        Prints one block per env as it finishes: a line per command (ok with the test
        runner's summary line, or FAIL with its exit code or deadline and its output's tail),
        then the env's result; the last line counts every command."""
        from envbuild.build.check import run_checks
        from envbuild.build.engine import load

        results = run_checks(load(app.settings.defs_dir), app.open_store(),
                             app.settings.node_dir, envs or None,
                             runtime=app.settings.oci_runtime, jobs=jobs, on_env=_print_env)
        failed = sum(not r.ok for r in results)
        click.echo(f"{len(results) - failed} passed, {failed} failed")
        return 1 if failed else 0

    @group.command("pack-diff")
    @click.argument("sandbox_id", metavar="SANDBOX")
    @click.option("--publish", "ref", metavar="REF", help="Ref for the snapshot's lock, e.g. snap/NAME.")
    @click.option("--max-file-size", default="1G", show_default=True, metavar="SIZE",
                  help="Refuse the snapshot if one file is larger.")
    @click.option("--max-total-size", default=None, metavar="SIZE",
                  help="Refuse the snapshot if the changes add up to more (apparent sizes: "
                       "sparse files count in full)  [default: the sandbox's disk limit, 10G]")
    @click.option("--json", "as_json", is_flag=True,
                  help="Print the result and every policy decision as JSON.")
    @pass_app
    def pack_diff(app: App, sandbox_id: str, ref: str | None, max_file_size: str,
                  max_total_size: str, as_json: bool) -> None:
        """Snapshot a running sandbox (envbuild run --keep) as a layer + derived lock."""
        from runtime_shim.node.nodecache import parse_size
        from runtime_shim.node.packdiff import SnapshotPolicy
        from runtime_shim.sdk.sandbox import Sandbox

        sb = Sandbox.attach(sandbox_id, store=app.open_store(), node_dir=app.settings.node_dir,
                            runtime=app.settings.oci_runtime)
        total = {} if max_total_size is None else {"max_total_bytes": parse_size(max_total_size)}
        # an attached sandbox's limits are not recorded: for_limits falls back to the default
        policy = SnapshotPolicy.for_limits(None, max_file_bytes=parse_size(max_file_size), **total)
        result = sb.pack_diff(ref, policy=policy, source_date_epoch=app.settings.source_date_epoch)
        if as_json:
            click.echo(json.dumps(result.to_json(), indent=1))
            return
        click.echo(f"layer {result.layer} ({result.size / 1e6:.1f} MB, {result.seconds:.2f}s)")
        click.echo(f"lock  {result.lock}" + (f" as {ref}" if ref else "")
                   + (" (snapshot chain squashed)" if result.squashed else ""))
        for d in result.report.decisions:
            click.echo(f"policy: {d['action']} {d['path']}: {d['reason']}", err=True)

    @group.command()
    @click.argument("ref")
    @click.option("--publish", "new_ref", metavar="REF2", required=True, help="Ref for the squashed lock.")
    @pass_app
    def squash(app: App, ref: str, new_ref: str) -> None:
        """Merge the snapshot layers at the top of REF's lock into one layer."""
        from runtime_shim.node.locks import resolve
        from runtime_shim.node.packdiff import squash_snapshots

        store = app.open_store()
        from runtime_shim.node.layout import NodeLayout

        scratch = NodeLayout(app.settings.node_dir).builds
        scratch.mkdir(parents=True, exist_ok=True)
        lock = resolve(store, ref)
        digest = squash_snapshots(store, lock, scratch=scratch, ref=new_ref)
        if digest is None:
            store.put_ref(new_ref, lock.digest)
            click.echo(f"{new_ref} {lock.digest} (nothing to squash: at most one snapshot layer)")
        else:
            click.echo(f"{new_ref} {digest}")

    @group.group()
    def sandbox() -> None:
        """Find and clean up sandboxes on this host."""

    @sandbox.command("ls")
    @pass_app
    def sandbox_ls(app: App) -> None:
        """List sandboxes (and whether the process that made them is alive)."""
        from runtime_shim.sdk.sandbox import list_sandboxes

        now = time.time()
        for s in list_sandboxes(app.settings.node_dir):
            state = ("expired" if s.expired(now) else "kept" if s.kept
                     else "alive" if s.alive else "orphaned")
            ttl = f"  expires in {s.expires - now:.0f}s" if s.expires and s.expires > now else ""
            click.echo(f"{s.id}  {s.backend:<9}  {state:<8}  {s.lock}{ttl}")

    @sandbox.command("network")
    @click.argument("sandbox_id", metavar="SANDBOX")
    @click.argument("dests", nargs=-1, metavar="[public|CIDR[:PORT]]...")
    @click.option("--off", is_flag=True, help="Refuse everything, DNS too.")
    @pass_app
    def sandbox_network(app: App, sandbox_id: str, dests: tuple[str, ...], off: bool) -> None:
        """Change what a running sandbox may reach, for connections from now on: 'public'
        (the public internet) and CIDR[:PORT] destinations (private ones included); none: DNS
        only. The sandbox must have been made with network (--network or --allow)."""
        from envbuild.errors import RuntimeShimError
        from runtime_shim.sdk.sandbox import set_sandbox_network

        if off and dests:
            raise RuntimeShimError("--off refuses everything: give it no destinations",
                                   hint="envbuild sandbox network ID --off, or ID public ...")
        set_sandbox_network(app.settings.node_dir, sandbox_id, False if off else list(dests))
        click.echo(f"sandbox {sandbox_id} network: " +
                   ("off" if off else " ".join(dests) + " + DNS" if dests else "DNS only"))

    @sandbox.command("rm")
    @click.argument("ids", nargs=-1, required=True)
    @pass_app
    def sandbox_rm(app: App, ids: tuple[str, ...]) -> int:
        """Kill, unmount and delete sandboxes by id (each one tried; exit 1 if any failed)."""
        from envbuild.errors import RuntimeShimError
        from runtime_shim.sdk.sandbox import remove_sandbox

        failed = 0
        for i in ids:
            try:
                remove_sandbox(app.settings.node_dir, i, app.settings.oci_runtime)
            except RuntimeShimError as e:
                failed += 1
                click.echo(f"failed  {i}: {e.message}" + (f" — {e.hint}" if e.hint else ""))
            else:
                click.echo(f"removed {i}")
        return 1 if failed else 0

    @group.group()
    def node() -> None:
        """This host's node cache: unpacked layers shared by builds and sandboxes."""

    @node.command("ls")
    @pass_app
    def node_ls(app: App) -> None:
        """List unpacked layers with their size and last use, then the lazy layer daemon: how
        it serves reads (passthrough, or the fuse fallback and why) and its lazy mounts."""
        from runtime_shim.lazyfs.control import daemon_request
        from runtime_shim.node.layout import NodeLayout
        from runtime_shim.node.nodecache import NodeCache

        cache = NodeCache(NodeLayout(app.settings.node_dir).node)
        layers = cache.usage()
        for u in layers:
            click.echo(f"{u.digest}  {u.size / 1e6:9.1f} MB  last used {time.ctime(u.last_used)}")
        click.echo(f"{len(layers)} layers, {sum(u.size for u in layers) / 1e6:.1f} MB")
        ping = daemon_request(cache.root, {"op": "ping"}, 5.0)
        if ping is None:
            click.echo("lazy daemon: not running (starts with the first lazy sandbox)")
            return
        why = f" ({ping['mode_reason']})" if ping.get("mode_reason") else ""
        click.echo(f"lazy daemon: pid {ping.get('pid')}, mode {ping.get('mode', 'fuse')}{why}, "
                   f"fetch concurrency {ping.get('fetch_concurrency')}, "
                   f"timeout {ping.get('fetch_timeout')} s, "
                   f"{ping.get('files_fetched', 0)} files fetched")
        for digest in cache.list_lazy():
            state = "mounted" if cache.lazy_mounted(digest) else "stale"
            click.echo(f"lazy {digest}  {state}")
        from runtime_shim.lazyfs.metalayer import describe

        for line in describe(cache.root):
            click.echo(line)

    @node.command("gc")
    @click.option("--max-size", default=None, metavar="SIZE",
                  help="Keep at most this much (e.g. 20G, 500M, 10%); 0 evicts every unused "
                       "layer.  [default: the node cache budget, $ENVBUILD_NODE_CACHE_MAX or "
                       "20% of its filesystem, at most 50G]")
    @pass_app
    def node_gc(app: App, max_size: str | None) -> None:
        """Evict least recently used layers that no live sandbox uses until the node cache
        is within its budget (and unmount unused lazy mounts)."""
        from envbuild.build.executor import sweep_stale_scratch
        from envbuild.settings import node_cache_budget
        from runtime_shim.isolation.runc import OciRuntime
        from runtime_shim.node.layout import NodeLayout
        from runtime_shim.node.nodecache import NodeCache
        from runtime_shim.sdk.sandbox import layers_in_use

        layout = NodeLayout(app.settings.node_dir)
        budget = node_cache_budget(max_size or app.settings.node_cache_max, app.settings.node_dir)
        cache = NodeCache(layout.node)
        keep = layers_in_use(layout)
        evicted = cache.evict(keep, budget)
        click.echo(f"evicted {len(evicted)} layer(s) (budget {budget / 1e6:.1f} MB); "
                   f"{len(keep)} in use by live sandboxes kept")
        swept = sweep_stale_scratch(layout.builds,
                                    OciRuntime(app.settings.oci_runtime,
                                               state_root=str(layout.runc)))
        if swept:
            click.echo(f"removed {len(swept)} scratch dir(s) of killed builds")

    @sandbox.command("gc")
    @pass_app
    def sandbox_gc(app: App) -> int:
        """Remove sandboxes past their TTL and those left behind by crashed processes (kept
        ones stay until their TTL): one line per sandbox, removed or failed with its cause;
        one failure never stops the others, and makes the exit code 1."""
        from runtime_shim.sdk.sandbox import sweep_sandboxes

        done = sweep_sandboxes(app.settings.node_dir, app.settings.oci_runtime)
        for r in done:
            click.echo((f"removed {r.id}" + (" (expired)" if r.reason == "expired" else ""))
                       if r.removed else f"failed  {r.id}: {r.error}")
        failed = sum(not r.removed for r in done)
        click.echo(f"removed {len(done) - failed} orphaned or expired sandbox(es)" +
                   (f", {failed} could not be removed" if failed else ""), err=bool(failed))
        return 1 if failed else 0


def _print_env(env: str, results) -> None:
    """One env's block of ``envbuild check`` output (see ``check``)."""
    for r in results:
        if r.ok:
            summary = f"  [{r.summary}]" if r.summary else ""
            click.echo(f"ok   {r.env:<20} {r.workspace:<16} {r.command}  ({r.seconds:.1f}s)"
                       f"{summary}")
            continue
        why = (f"timed out after {r.timeout:g}s" if r.timed_out
               else f"exit {r.exit_code}, {r.seconds:.1f}s")
        click.echo(f"FAIL {r.env:<20} {r.workspace:<16} {r.command}  ({why})")
        tail = r.tail
        click.echo("\n".join("     | " + line for line in tail) if tail
                   else "     | (no output)")
    bad = sum(not r.ok for r in results)
    total = sum(r.seconds for r in results)
    click.echo(f"env {env}: {'FAILED' if bad else 'ok'} ({len(results) - bad}/{len(results)} "
               f"checks passed, {total:.1f}s)")
