"""envbuild.jobs: training-job manifests — model, load (schema, line-numbered errors), resolve,
verify.

* ``envbuild.jobs.model`` — ``JobManifest``, ``SandboxGroup``, ``Pinned``,
  ``PinnedLayer``: the model, importing only foundation modules (errors, sizes, the digest
  grammar) and the runtime's ``Limits``, so a training loop reads manifests without the
  definition loader;
* ``create_sandbox(group, store=..., node_dir=...)`` — one sandbox of a resolved group
  (``envbuild.jobs.start``; jobs drive the runtime's SDK, the runtime never imports jobs);
* ``load_job_manifest(path)`` / ``parse_job_manifest(text)`` — YAML or JSON, checked against
  ``envbuild/defs/schema/jobmanifest.json``; ``JobManifestError`` lists every problem;
* ``resolve_job_manifest(manifest, store)`` — pin refs to digests and record each lock's
  closure (``envbuild job resolve``);
* ``verify_job_manifest(manifest, store)`` — every lock, config, layer and TOC present and
  intact (``envbuild job verify``);
* ``write_job_manifest`` / ``render_job_manifest`` / ``default_output`` — deterministic text,
  written atomically.

The names below are imported on first use (PEP 562), so ``import envbuild.jobs.model`` does not
load the loader and its schema validator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from envbuild._lazy import lazy_exports

_EXPORTS = {
    "JobManifest": "model", "Pinned": "model",
    "PinnedLayer": "model", "SandboxGroup": "model",
    "JobManifestError": "load", "default_output": "load", "load_job_manifest": "load",
    "parse_job_manifest": "load", "render_job_manifest": "load", "write_job_manifest": "load",
    "resolve_job_manifest": "resolve", "create_sandbox": "start",
    "VerifyProblem": "verify", "VerifyReport": "verify", "verify_job_manifest": "verify",
}

__all__ = [
    "JobManifest", "JobManifestError", "Pinned", "PinnedLayer", "SandboxGroup",
    "VerifyProblem", "VerifyReport", "create_sandbox", "default_output", "load_job_manifest",
    "parse_job_manifest", "render_job_manifest", "resolve_job_manifest",
    "verify_job_manifest", "write_job_manifest",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from envbuild.jobs.load import (
        JobManifestError,
        default_output,
        load_job_manifest,
        parse_job_manifest,
        render_job_manifest,
        write_job_manifest,
    )
    from envbuild.jobs.model import JobManifest, Pinned, PinnedLayer, SandboxGroup
    from envbuild.jobs.resolve import resolve_job_manifest
    from envbuild.jobs.start import create_sandbox
    from envbuild.jobs.verify import VerifyProblem, VerifyReport, verify_job_manifest


__getattr__, __dir__ = lazy_exports(__name__, {k: f".{v}" for k, v in _EXPORTS.items()})
