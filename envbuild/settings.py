"""Settings, read once at the edge (CLI or SDK) and passed down; never a module global."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_STORE = "cache"
DEFAULT_DEFS = "envdefs"
#: The node cache budget unless ENVBUILD_NODE_CACHE_MAX says otherwise (``node_cache_budget``).
DEFAULT_NODE_CACHE_MAX = "20%"
#: ... and never more than this by default, however big the filesystem.
DEFAULT_NODE_CACHE_CAP = 50 << 30


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every command needs to know about its surroundings.

    ``node_dir`` holds this host's node cache and build scratch space (never shared between
    hosts). ``store_url`` is a directory path (the local store) or ``s3://BUCKET/PREFIX``.
    ``source_date_epoch`` clamps every mtime written into a layer.
    """

    defs_dir: Path = Path(DEFAULT_DEFS)
    store_url: str = DEFAULT_STORE
    source_date_epoch: int = 0
    jobs: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    node_dir: Path = dataclasses.field(default_factory=lambda: default_node_dir(os.environ))
    oci_runtime: str = "runc"
    # S3 issue: endpoint for s3:// stores (None: boto3's own config, e.g. AWS_ENDPOINT_URL) and
    # the remote build cache a build pulls layers from / pushes them to (store URLs)
    s3_endpoint: str | None = None
    cache_from: str | None = None
    cache_to: str | None = None
    # The cap of one build layer's writes (envbuild.build.executor; runtime_shim.isolation.scratchfs):
    # ENVBUILD_BUILD_DISK (a size, e.g. 50G; 0: no cap) and ENVBUILD_BUILD_INODES.
    build_disk_bytes: int | None = 50 << 30
    build_inodes: int | None = 5_000_000
    # hosts of docker:// stores spoken to over plain HTTP although not loopback
    registry_insecure: tuple[str, ...] = ()
    # The node cache's budget (unpacked layers; ``envbuild node gc`` evicts down to it):
    # ENVBUILD_NODE_CACHE_MAX, a size (50G) or a share of the node dir's filesystem (20%).
    node_cache_max: str = DEFAULT_NODE_CACHE_MAX
    # Ray build issue (15): lifetime of a build lease in the store (envbuild.store.lease),
    # ENVBUILD_LEASE_TTL seconds: how long a dead builder can keep others waiting.
    lease_ttl: float = 30.0
    # Directories outside the source root that definitions may read sources from (issue 34,
    # item 5): the node operator's opt-in for trusted definition trees, never the definition's.
    # ENVBUILD_TRUSTED_SOURCES (absolute paths, ':'-separated) or --trust-sources DIR.
    trusted_sources: tuple[str, ...] = ()
    # Issue 34: the node's budget of host-wide tables and disk (runtime_shim.node.admission):
    # ENVBUILD_HOST_RESERVE, ENVBUILD_DISK_RESERVE, ENVBUILD_NODE_BUDGET, as given; parsed by
    # ``BudgetSettings.from_env`` where a build or sandbox needs it (a command that makes
    # neither, such as ``envbuild layer ls``, must not import the runtime:
    # tests/integration/test_cli_startup.py; and settings sit below the runtime, never above)
    budget_env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        from envbuild.errors import EnvbuildError, SettingsError
        from envbuild.sizes import parse_size

        sde = environ.get("SOURCE_DATE_EPOCH", "0")
        try:
            epoch = int(sde)
        except ValueError:
            raise SettingsError(f"SOURCE_DATE_EPOCH is not an integer: {sde!r}",
                                hint="set it to seconds since 1970, e.g. 0") from None
        disk = environ.get("ENVBUILD_BUILD_DISK")
        inodes = environ.get("ENVBUILD_BUILD_INODES")
        try:
            build_disk = parse_size(disk, what="ENVBUILD_BUILD_DISK") if disk else cls.build_disk_bytes
            build_inodes = int(inodes) if inodes else cls.build_inodes
        except (ValueError, EnvbuildError):
            raise SettingsError(f"ENVBUILD_BUILD_DISK / ENVBUILD_BUILD_INODES not a size / count: "
                                f"{disk!r} / {inodes!r}", hint="e.g. 50G and 5000000") from None
        node_max = environ.get("ENVBUILD_NODE_CACHE_MAX") or DEFAULT_NODE_CACHE_MAX
        node_cache_budget(node_max, Path("/"))  # refuse a bad value here, at the edge
        ttl_text = environ.get("ENVBUILD_LEASE_TTL") or "30"
        try:
            lease_ttl = float(ttl_text)
            if not 0 < lease_ttl < 86400:
                raise ValueError
        except ValueError:
            raise SettingsError(f"ENVBUILD_LEASE_TTL is not a number of seconds: {ttl_text!r}",
                                hint="e.g. 30") from None
        return cls(
            trusted_sources=trusted_sources(environ),
            budget_env=tuple((k, environ[k]) for k in BUDGET_ENV if k in environ),
            node_cache_max=node_max,
            lease_ttl=lease_ttl,
            build_disk_bytes=build_disk or None,
            build_inodes=build_inodes or None,
            defs_dir=Path(environ.get("ENVBUILD_DEFS", DEFAULT_DEFS)),
            store_url=environ.get("ENVBUILD_STORE", DEFAULT_STORE),
            source_date_epoch=epoch,
            node_dir=default_node_dir(environ),
            oci_runtime=environ.get("ENVBUILD_OCI_RUNTIME", "runc"),
            s3_endpoint=environ.get("ENVBUILD_S3_ENDPOINT") or None,
            cache_from=environ.get("ENVBUILD_CACHE_FROM") or None,
            cache_to=environ.get("ENVBUILD_CACHE_TO") or None,
            registry_insecure=tuple(h.strip() for h in
                                    environ.get("ENVBUILD_REGISTRY_INSECURE", "").split(",")
                                    if h.strip()),
        )


#: The environment variable naming trusted source directories (``Settings.trusted_sources``).
TRUSTED_SOURCES_ENV = "ENVBUILD_TRUSTED_SOURCES"


def trusted_sources(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The directories of ``$ENVBUILD_TRUSTED_SOURCES`` (``os.pathsep``-separated), each
    absolute: trust never depends on the working directory. Raises ``SettingsError``."""
    return check_trusted_sources(environ.get(TRUSTED_SOURCES_ENV, "").split(os.pathsep))


def check_trusted_sources(paths) -> tuple[str, ...]:
    """``paths`` without empty entries, normalised; a relative one raises ``SettingsError``."""
    from envbuild.errors import SettingsError

    out = []
    for p in paths:
        if not p:
            continue
        if not os.path.isabs(p):
            raise SettingsError(f"trusted source directory {p!r} is not an absolute path",
                                hint=f"name it from / (--trust-sources / {TRUSTED_SOURCES_ENV})")
        out.append(os.path.normpath(p))
    return tuple(out)


#: The environment variables of the node budget (``Settings.budget_env``).
BUDGET_ENV = ("ENVBUILD_HOST_RESERVE", "ENVBUILD_DISK_RESERVE", "ENVBUILD_NODE_BUDGET")


def node_cache_budget(spec: str, node_dir: Path) -> int:
    """Bytes the node cache may hold: ``spec`` is a size (``50G``) or a percentage of the
    filesystem holding ``node_dir`` (``20%``: its nearest existing ancestor is measured). The
    default ``20%`` is capped at ``DEFAULT_NODE_CACHE_CAP``; an explicit value is not."""
    from envbuild.sizes import parse_percent, parse_size

    text = spec.strip()
    if not text.endswith("%"):
        return parse_size(text, what="ENVBUILD_NODE_CACHE_MAX")
    share = parse_percent(text, what="ENVBUILD_NODE_CACHE_MAX")
    probe = Path(node_dir).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    budget = int(st.f_blocks * st.f_frsize * share)
    return min(budget, DEFAULT_NODE_CACHE_CAP) if text == DEFAULT_NODE_CACHE_MAX else budget


def default_node_dir(environ: Mapping[str, str]) -> Path:
    """The node cache (unpacked layers, build scratch, sandboxes): ``$ENVBUILD_NODE_CACHE``,
    else /var/lib/envbuild as root, else ~/.cache/envbuild."""
    if environ.get("ENVBUILD_NODE_CACHE"):
        return Path(environ["ENVBUILD_NODE_CACHE"])
    if os.geteuid() == 0:
        return Path("/var/lib/envbuild")
    return Path.home() / ".cache" / "envbuild"
