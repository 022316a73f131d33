"""envbuild: upstream's directory-watch tests against a ``--fleet`` server (./conftest.py)."""

from tests.integration.e2b_upstream.fleet import upstream

globals().update(upstream("sync.files.test_watch"))
