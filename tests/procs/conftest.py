"""The servers tests/procs share (helpers: tests/support/serve_processes.py)."""
from __future__ import annotations

import pytest

from tests.support.serve_processes import start

@pytest.fixture(scope="module")
def two_frontends(tmp_path_factory):
    """N = 2, few admitted requests (2 running + 1 queued), so overload is easy to reach;
    sleep mode on (its routes, served across the frontends)."""
    tmp = tmp_path_factory.mktemp("procs2")
    server = start(tmp, "--api-server-count", "2", "--max-num-seqs", "2",
                   "--max-queued-requests", "1", "--enable-sleep-mode")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    server = start(tmp_path_factory.mktemp("single"), "--max-num-seqs", "2",
                   "--max-queued-requests", "1")
    yield server
    server.stop()
