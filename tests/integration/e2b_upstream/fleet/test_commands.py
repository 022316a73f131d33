"""envbuild: upstream's commands tests against a ``--fleet`` server (./conftest.py)."""

from tests.integration.e2b_upstream.fleet import upstream

globals().update(upstream(
    "sync.commands.test_run", "sync.commands.test_send_stdin", "sync.commands.test_env_vars",
    "aio.commands.test_cmd_kill"))
