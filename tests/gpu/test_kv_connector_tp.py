"""The KV connector under tensor parallelism (issue 36, gpu/kv_transfer/connector.py): each TP rank
reads its own KV-head shard of the same blocks, and rank 0 combines every rank's poll
(`RankReads`, through `TPKVConnector`) into the one landed/failed/late triple the
scheduler reads: landed once every rank's read has (then, and only then, the prefill side
is told), failed as soon as any rank's has, late while another rank's read may still write
into the blocks (TAILRACE_KV_READ_TIMEOUT_S on one rank included), over once every rank's
is. NIXL stands in as a fake (tests/tp/test_tp_pd.py runs the real one, two TP 2
instances); the side channel's per-rank answers and the worker ranks' flags too."""
from __future__ import annotations

import json
import threading
import time

import pytest
import trio

from gpu.interface import KVRead
from gpu.kv_transfer.connector import KVConnector, RankReads, TPKVConnector
from tests.support.fake_nixl import FakeNixl as LateFakeNixl

WHERE = ("10.0.0.1", 5600)


def _read(sid: str = "d1") -> KVRead:
    return KVRead(sid, "P", f"req-{sid}", (4, 5), *WHERE, (1, 2))


def test_a_read_lands_when_every_rank_has_and_only_then_is_the_prefill_side_told():
    ranks = RankReads(2)
    ranks.started(_read())
    ranks.add(0, (("d1",), (), ()))
    ranks.add(1, ((), (), ()))
    assert ranks.results() == ((), (), (), []) and ranks.reading
    ranks.add(0, ((), (), ()))
    ranks.add(1, (("d1",), (), ()))
    assert ranks.results() == (("d1",), (), (), [_read()])
    assert not ranks.reading


def test_a_rank_that_fails_while_another_still_reads_keeps_the_blocks_until_it_is_over():
    ranks = RankReads(2)
    ranks.started(_read())
    ranks.add(0, ((), (), ()))
    ranks.add(1, ((), (("d1", "the KV read failed (boom)"),), ()))
    # the request ends now; rank 0's read may still write into its blocks: late
    assert ranks.results() == ((), (("d1", "the KV read failed (boom) (tensor-parallel "
                                        "rank 1)"),), ("d1",), [])
    ranks.add(0, ((), (), ()))
    assert ranks.results() == ((), (), (), [])
    ranks.add(0, (("d1",), (), ()))                 # over everywhere: the blocks are free
    assert ranks.results() == (("d1",), (), (), [])   # not told: rank 1 read nothing
    assert not ranks.reading


def test_failures_of_every_rank_in_one_round_are_one_failure_with_rank_0s_error():
    ranks = RankReads(2)
    ranks.started(_read())
    ranks.add(1, ((), (("d1", "one"),), ()))
    ranks.add(0, ((), (("d1", "zero"),), ()))
    assert ranks.results() == ((), (("d1", "zero"),), (), [])
    assert not ranks.reading


class FakeNixl(LateFakeNixl):
    """test_kv_connector_late's fake (handles whose state the test sets: "PROC", "DONE" or
    an error), with reads started and notifications sent."""

    def __init__(self) -> None:
        super().__init__()
        self.notified: list[tuple[str, bytes]] = []
        self.notifs: list[bytes] = []

    def read(self, name, layout, remote, local, notif=b""):
        handle = object()
        self.state[handle] = "PROC"
        self.notifs.append(notif)
        return handle

    def notify(self, name: str, message: bytes) -> None:
        self.notified.append((name, message))


def _rank(rank: int, timeout_s: float) -> tuple[KVConnector, FakeNixl]:
    kv = KVConnector.__new__(KVConnector)          # no NIXL agent, no side channel socket
    fake = FakeNixl()
    kv.kv, kv.lock, kv.read_timeout_s = fake, threading.Lock(), timeout_s
    kv.rank, kv.tp_size = rank, 2
    kv._reads, kv._late, kv._stale, kv._failed = {}, {}, set(), []
    kv._remotes = {WHERE: ("P", f"agent-P-rank{rank}", None)}   # the layout, asked before
    return kv, fake


def test_a_read_past_the_timeout_on_one_rank_is_late_then_lands_and_the_prefill_is_told():
    zero, nixl0 = _rank(0, 30.0)
    one, nixl1 = _rank(1, 0.0)             # rank 1's read times out at once

    def exchange(reads, poll):             # gpu/worker/tp.py StepBroadcast.kv_exchange
        one.start_reads(reads)
        return [poll(), one.poll()]

    tp = TPKVConnector(zero, exchange)
    tp.start_reads([_read()])
    assert nixl0.notifs == nixl1.notifs == [b""]     # the READs notify nobody under TP
    (h0,), (h1,) = nixl0.state, nixl1.state
    nixl0.state[h0] = "DONE"
    time.sleep(0.01)
    loaded, failed, late = tp.poll()
    assert loaded == () and late == ("d1",)
    assert "took over 0 s" in failed[0][1] and "(tensor-parallel rank 1)" in failed[0][1]
    assert tp.reading and nixl0.notified == []
    assert tp.poll() == ((), (), ())                 # rank 1's read is still NIXL's
    nixl1.state[h1] = "DONE"                         # it landed after all
    assert tp.poll() == (("d1",), (), ())            # the scheduler frees the blocks now
    assert nixl0.notified == [("agent-P-rank0", b"req-d1")] and nixl1.notified == []
    assert not tp.reading


def test_the_side_channel_answers_each_ranks_layout_and_the_size_for_a_rank_past_them():
    from gpu.kv_transfer.side_channel import fetch_layout, no_rank_message
    from pipeline.core.kv_task import serve_side_channel

    layouts = [json.dumps({"engine_id": "P", "tp_size": 2, "rank": r}).encode() + b"\n"
               for r in range(2)]
    got = {}

    async def main():
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_side_channel, listeners[0], layouts, lambda rid: None,
                               no_rank_message("P", 2))
            for rank in (0, 1, 2):
                got[rank] = await trio.to_thread.run_sync(fetch_layout, "127.0.0.1", port, rank)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert got[0]["rank"] == 0 and got[1]["rank"] == 1
    assert got[2] == {"engine_id": "P", "tp_size": 2}


def test_worker_ranks_get_the_connector_with_rank_0s_engine_id():
    from pipeline.core.config import EngineConfig
    from pipeline.layouts.tp_procs import worker_flags
    from stages.kv_transfer import KVTransferConfig

    cfg = EngineConfig(tensor_parallel_size=2, kv_transfer_config=(
        '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'))
    flags = worker_flags(cfg)
    parsed = KVTransferConfig.parse(flags[flags.index("--kv-transfer-config") + 1])
    assert parsed.engine_id == cfg.kv_transfer_config.engine_id
    assert parsed.kv_role == "kv_both"
