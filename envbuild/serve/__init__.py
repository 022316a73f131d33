"""``envbuild serve``: an E2B-compatible server over runtime_shim sandboxes, so that the
unmodified ``e2b`` SDK (``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_API_KEY``) drives envbuild.

The control plane (``control``) creates sandboxes from a template (an env name, ref or lock
digest of the store) and kills, lists, times them out; envd (``envd_process``,
``envd_fs``, ``files``) runs commands and file operations in one. ``app`` routes and
authenticates: API keys (``auth``) for the control plane, one access token per sandbox for
envd. ``sandboxes`` keeps the server's sandboxes, ``records`` their records on disk (a
sandbox outlives the server), ``backend`` makes, pauses and resumes them.

    from envbuild.serve import ServeOptions, serve_forever
"""

from __future__ import annotations

from envbuild.serve.app import ServeOptions, make_app, serve_forever, start
from envbuild.serve.auth import ApiKeys
from envbuild.serve.backend import NodeBackend

__all__ = ["ApiKeys", "NodeBackend", "ServeOptions", "make_app", "serve_forever", "start"]
