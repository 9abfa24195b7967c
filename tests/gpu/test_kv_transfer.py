"""gpu/kv_transfer/nixl.py: KV blocks read from one cache into another over NIXL (UCX, DRAM to
DRAM on loopback), with SmolLM2-135M's cache shape (30 layers, 3 KV heads of 64)."""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("nixl")

from gpu.layers.attention import KVCache                                     # noqa: E402
from gpu.kv_transfer.nixl import NixlKV, TransferFailed, _runs, kv_bytes_per_token  # noqa: E402

LAYERS, HEADS, DIM, BS = 30, 3, 64, 16


def cache(blocks: int) -> KVCache:
    return KVCache(LAYERS, blocks, BS, HEADS, DIM, torch.float32, "cpu")


def wait(kv: NixlKV, handle, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not kv.done(handle):
        assert time.monotonic() < deadline, "the read did not finish"
        time.sleep(0.001)


@pytest.fixture(scope="module")
def pair():
    prefill, decode = cache(12), cache(8)
    g = torch.Generator().manual_seed(0)
    for t in (*prefill.k, *prefill.v):
        t.copy_(torch.randn(t.shape, generator=g))
    p, d = NixlKV("prefill-test", prefill), NixlKV("decode-test", decode)
    yield p, d
    p.close()
    d.close()


def test_blocks_are_read_layer_by_layer_and_the_owner_is_notified(pair):
    p, d = pair
    remote = d.add_remote(p.layout())
    src, dst = [3, 4, 5, 9], [0, 1, 2, 6]       # two runs on each side
    handle = d.read(remote, p.layout(), src, dst, notif=b"req-1")
    wait(d, handle)
    for layer in range(LAYERS):
        for a, b in ((p.cache.k[layer], d.cache.k[layer]), (p.cache.v[layer], d.cache.v[layer])):
            assert torch.equal(b[dst], a[src])
    assert torch.count_nonzero(d.cache.k[0][[3, 4, 5, 7]]) == 0     # nothing else written
    deadline = time.monotonic() + 10
    got: list[bytes] = []
    while b"req-1" not in got and time.monotonic() < deadline:
        got += p.notifications().get("decode-test", [])
        time.sleep(0.01)
    assert b"req-1" in got


def test_bad_reads_are_refused_before_nixl(pair):
    p, d = pair
    remote = d.add_remote(p.layout())
    with pytest.raises(ValueError, match="outside the remote cache"):
        d.read(remote, p.layout(), [12], [0])
    with pytest.raises(ValueError, match="as many"):
        d.read(remote, p.layout(), [1, 2], [0])
    other = NixlKV("other-shape", KVCache(LAYERS, 4, BS, HEADS, 32, torch.float32, "cpu"))
    try:
        with pytest.raises(ValueError, match="not this one's"):
            d.add_remote(other.layout())
    finally:
        other.close()


def test_runs_and_bytes_per_token():
    assert _runs([3, 4, 5, 9], [0, 1, 2, 6]) == [(3, 0, 3), (9, 6, 1)]
    assert _runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]
    assert kv_bytes_per_token(LAYERS, HEADS, DIM, torch.float32) == 2 * 30 * 3 * 64 * 4


def test_a_remote_that_is_gone_is_a_clear_error(pair):
    p, d = pair
    remote = d.add_remote(p.layout())
    d.remove_remote(remote)
    with pytest.raises(TransferFailed, match="could not start the KV read"):
        d.read(remote, p.layout(), [1], [0])
