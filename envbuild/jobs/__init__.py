"""envbuild.jobs: training-job manifests — load (schema, line-numbered errors), resolve, verify.

The model (``JobManifest``, ``SandboxGroup``, …) lives in ``runtime_shim.jobs`` so the runtime
shim reads manifests without this package; this side adds what needs definitions-style
validation or the store:

* ``load_job_manifest(path)`` / ``parse_job_manifest(text)`` — YAML or JSON, checked against
  ``envbuild/defs/schema/jobmanifest.json``; ``JobManifestError`` lists every problem;
* ``resolve_job_manifest(manifest, store)`` — pin refs to digests and record each lock's
  closure (``envbuild job resolve``);
* ``verify_job_manifest(manifest, store)`` — every lock, config, layer and TOC present and
  intact (``envbuild job verify``);
* ``write_job_manifest`` / ``render_job_manifest`` / ``default_output`` — deterministic text,
  written atomically.
"""

from __future__ import annotations

from envbuild.jobs.load import (
    JobManifestError,
    default_output,
    load_job_manifest,
    parse_job_manifest,
    render_job_manifest,
    write_job_manifest,
)
from envbuild.jobs.resolve import resolve_job_manifest
from envbuild.jobs.verify import VerifyProblem, VerifyReport, verify_job_manifest
from runtime_shim.jobs import GroupLimits, JobManifest, Pinned, PinnedLayer, SandboxGroup

__all__ = [
    "GroupLimits",
    "JobManifest",
    "JobManifestError",
    "Pinned",
    "PinnedLayer",
    "SandboxGroup",
    "VerifyProblem",
    "VerifyReport",
    "default_output",
    "load_job_manifest",
    "parse_job_manifest",
    "render_job_manifest",
    "resolve_job_manifest",
    "verify_job_manifest",
    "write_job_manifest",
]
