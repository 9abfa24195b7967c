"""gpt-oss's sliding-window layers in a KV pool of their own (the hybrid KV cache): the KV
sizing that counts the memory it saves, and the runner reading the sliding layers through the
block -> slot map on the torch and Triton paths. (Through the engine:
tests/engine/test_engine_sliding_kv.py.)"""

import pytest

from gpu.models.registry import config_from_hf
from gpu.layers.attention import KVCache, hybrid_layout, split_for_sliding
from gpu.config.model import ModelConfig
from tests.support.hf_models import make_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_sliding")
    make_hf_model("gpt_oss", path, seed=4)          # 3 layers: 0 and 2 sliding (window 6), 1 full
    return path


def test_split_counts_the_saved_memory():
    # gpt-oss-20b-like: 24 layers, 12 sliding (window 128), blocks of 16, 256 sequences,
    # 2048-token steps: 256 * (8 + 2) + 2 * 128 slots; the rest of 12 layers' share buys full blocks
    full, slots = split_for_sliding(100_000, 24, 12, 128, 16, 256, 2048)
    assert slots == 2816 and full == (100_000 * 24 - 2816 * 12) // 12
    assert full > 1.9 * 100_000                                 # nearly twice the tokens
    assert split_for_sliding(100, 24, 12, 128, 16, 256, 2048) == (100, 100)   # too small to split
    base = dict(model_type="gpt_oss", vocab_size=8, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=6)
    assert hybrid_layout(config_from_hf(base), 1000, 16, 4, 64)[1:] == ((0, 2), 4 * 3 + 8)
    dense = config_from_hf({**base, "model_type": "qwen3", "num_local_experts": 0})
    assert hybrid_layout(dense, 1000, 16, 4, 64) == (1000, (), 0)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_runner_reads_sliding_layers_through_the_slot_map(model_dir, use_triton):
    """The runner alone (block size 4, window 6), torch path and Triton kernels (the
    interpreter on CPU): a sequence prefilled in two chunks then decoded, its sliding layers in
    a 5-slot pool whose slots move from passed blocks to new ones, gives the logits of a plain
    cache. Blocks 9 and 2 are reused after the window passed them (their slots go to block 4)."""
    import torch

    from gpu.loader.decoder import load_model
    from gpu.interface import SeqChunk, SeqStart, StepPlan
    from gpu.worker.runner import ModelRunner
    from gpu.worker.sampler import SamplingOptions

    lm = load_model(model_dir, dtype="float32", progress=False).model
    c = lm.config
    ids = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101, 11, 12]
    table = (9, 2, 7, 0, 11, 4)
    greedy = SamplingOptions(temperature=0.0)

    def plans(hybrid):
        upd = (lambda *u: u) if hybrid else (lambda *u: ())
        return [
            StepPlan(1, (SeqChunk("a", tuple(ids[:10]), 0, table[:3], False),),
                     (SeqStart("a", tuple(ids), greedy),), kv_updates=upd((9, 0), (2, 1), (7, 2))),
            StepPlan(2, (SeqChunk("a", tuple(ids[10:19]), 10, table[:5], True),),
                     kv_updates=upd((0, 3), (11, 4))),
            # next query at 19 sees 14..19: blocks 0-1 (ids 9, 2) are passed; block 5 (id 4) takes slot 0
            StepPlan(3, (SeqChunk("a", (ids[19],), 19, table, True),), kv_updates=upd((9, -1), (2, -1), (4, 0))),
            StepPlan(4, (SeqChunk("a", (ids[20],), 20, table, True),)),
            StepPlan(5, (SeqChunk("a", (ids[21],), 21, table, True),)),
        ]

    def logits(cache, hybrid):
        runner = ModelRunner(lm, cache, device=torch.device("cpu"), use_triton=use_triton)
        seen = []
        orig = lm.compute_logits
        lm.compute_logits = lambda h: seen.append(orig(h)) or seen[-1]
        try:
            for plan in plans(hybrid):
                runner.execute(plan)
        finally:
            lm.compute_logits = orig
        return torch.cat(seen)

    shape = (c.num_hidden_layers, 12, 4, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    plain = logits(KVCache(*shape), False)
    hybrid_cache = KVCache(*shape, sliding_layers=(0, 2), num_sliding_blocks=5)
    assert tuple(hybrid_cache.k[0].shape)[0] == 5 and tuple(hybrid_cache.k[1].shape)[0] == 12
    got = logits(hybrid_cache, True)
    assert got.shape[0] == 4
    torch.testing.assert_close(got, plain, atol=1e-4, rtol=1e-4)
    assert hybrid_cache.sliding_map[[9, 2, 7, 0, 11, 4]].tolist() == [0, 0, 2, 3, 4, 0]
