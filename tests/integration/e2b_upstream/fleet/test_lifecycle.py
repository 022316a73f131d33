"""envbuild: upstream's create, metadata (list), kill and timeout tests against a ``--fleet``
server (./conftest.py), the ones of memory pause a strict xfail (``FLEET_CANNOT``)."""

from tests.integration.e2b_upstream.fleet import upstream

globals().update(upstream("sync.test_create", "sync.test_kill", "sync.test_timeout"))
