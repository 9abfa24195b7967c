"""The decode side's KV connector (gpu/kv_transfer/connector.py) with a read that outlives
TAILRACE_KV_READ_TIMEOUT_S (issue 36): its request ends at the timeout, but NIXL may still
land the read into its blocks, so the poll names it `late` (StepResult.kv_late) and keeps
watching it; the scheduler frees the blocks only when the read is over. NIXL stands in as
a fake (tests/gpu/test_kv_transfer.py and tests/e2e/test_e2e_pd.py run the real one)."""
from __future__ import annotations

import threading
import time

from gpu.kv_transfer.connector import KVConnector
from tests.support.fake_nixl import FakeNixl


def connector(timeout_s: float) -> tuple[KVConnector, FakeNixl]:
    kv = KVConnector.__new__(KVConnector)          # no NIXL agent, no side channel socket
    fake = FakeNixl()
    kv.kv, kv.lock, kv.read_timeout_s = fake, threading.Lock(), timeout_s
    kv._reads, kv._late, kv._remotes, kv._stale, kv._failed = {}, {}, {}, set(), []
    return kv, fake


def reading(kv: KVConnector, sid: str, fake: FakeNixl, deadline: float) -> object:
    handle = object()
    fake.state[handle] = "PROC"
    kv._reads[sid] = (handle, deadline, ("10.0.0.1", 5600), "agent-1")
    return handle


def test_a_read_past_the_timeout_ends_its_request_but_is_watched_until_it_lands():
    kv, fake = connector(30.0)
    slow = reading(kv, "d1", fake, time.monotonic() - 1)       # its deadline has passed
    fast = reading(kv, "d2", fake, time.monotonic() + 60)
    fake.state[fast] = "DONE"
    loaded, failed, late = kv.poll()
    assert loaded == ("d2",)
    assert [sid for sid, _ in failed] == ["d1"] and "took over 30 s" in failed[0][1]
    assert late == ("d1",) and kv.reading          # still NIXL's: its blocks must wait
    assert kv.poll() == ((), (), ())               # in flight: nothing to say
    fake.state[slow] = "DONE"                      # it landed after all
    assert kv.poll() == (("d1",), (), ())          # now the scheduler may free its blocks
    assert not kv.reading


def test_a_late_read_that_fails_is_named_failed_and_its_agent_dropped_once_idle():
    kv, fake = connector(0.0)
    slow = reading(kv, "d1", fake, time.monotonic() - 1)
    kv._remotes[("10.0.0.1", 5600)] = ("P", "agent-1", None)
    _, failed, late = kv.poll()
    assert late == ("d1",) and len(failed) == 1
    fake.state[slow] = "nixlRemoteDisconnectError"
    loaded, failed, late = kv.poll()
    assert loaded == () and late == ()
    assert failed == (("d1", "the late KV read failed: the KV read failed "
                             "(nixlRemoteDisconnectError)"),)
    assert fake.removed == ["agent-1"] and not kv.reading
