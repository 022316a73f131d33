"""envbuild: upstream's tests of ``./fleet`` (a subset of this package's, imported from their
modules) against ``envbuild serve --fleet`` (``fleet_serving``): one server and the fleet's
daemons for this directory, on the session's Ray cluster; what a fleet cannot do is a strict
xfail (``FLEET_CANNOT`` of ../conftest.py)."""

from __future__ import annotations

import pytest

from tests.integration.e2b_upstream.conftest import fleet_serving


@pytest.fixture(scope="package")
def e2b_server(e2b_built, ray_cluster):
    """The ``--fleet`` server for ``./fleet``, in place of the one-node one."""
    yield from fleet_serving(e2b_built, ray_cluster)
