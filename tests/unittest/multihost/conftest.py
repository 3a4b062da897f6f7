"""The ``test_hosts`` fixture: three test hosts (network, PID, UTS and mount namespaces) and a head
on a private bridge, for real multi-host MPI runs on one machine (``tests/support/testhosts.py``).

Skips with the reason (or fails, where ``TRTLLM_LIVENESS_REQUIRE`` names the facility) where
network or PID namespaces, or the tools, are missing. At teardown, also on failure, everything is
removed by namespace; a leftover namespace, process, veth or work directory fails the test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import pytest

from tests.support.facilities import require_facility
from tests.support.process_tracker import ProcessTracker
from tests.support.testhosts import TestHosts


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multihost: runs real MPI jobs across namespace test hosts")


# What sshd gives a login: a fresh environment (the tests' agent otherwise passes the head's through).
LOGIN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}


def _hosts(procs: ProcessTracker, **options: Mapping[str, str]) -> Iterator[TestHosts]:
    require_facility("testhosts")
    tmp_mode = os.stat("/tmp").st_mode  # PRRTE chmods the directory of an --output file: never /tmp's
    hosts = TestHosts(on_start=procs.adopt, **options)
    try:
        hosts.start()
        yield hosts
    finally:
        left = hosts.close()
    assert not left, f"test hosts left behind: {left}"
    assert os.stat("/tmp").st_mode == tmp_mode, f"/tmp's mode changed to {oct(os.stat('/tmp').st_mode)}"


@pytest.fixture
def test_hosts(procs: ProcessTracker) -> Iterator[TestHosts]:
    """hostA, hostB, hostC and the head, up; removed at teardown (a leftover fails the test)."""
    yield from _hosts(procs)


@pytest.fixture
def login_hosts(procs: ProcessTracker) -> Iterator[TestHosts]:
    """:func:`test_hosts` whose ranks get only what the launcher forwards, as over ssh: the agent
    starts each host's command with :data:`LOGIN_ENV` alone."""
    yield from _hosts(procs, login_env=LOGIN_ENV)
