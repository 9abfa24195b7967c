"""The fixture tests/web's HTTP tests share: web.server.serve over a fake engine on port 0."""
from __future__ import annotations

from functools import partial

import httpx
import pytest

from tests.support.fake_engine import FakeEngine
from web.server import listen_socket, serve


@pytest.fixture
async def served(nursery):
    engine = FakeEngine()
    binds = await nursery.start(partial(serve, engine, listen_socket("127.0.0.1", 0),
                                        log_level="warning"))
    async with httpx.AsyncClient(base_url=binds[0], timeout=10) as http:
        yield engine, http
    nursery.cancel_scope.cancel()
