"""Tensor parallelism on the default model, SmolLM2-135M (9 query heads, 3 KV heads, tied
embeddings, the Q4_1 GGUF): at TP = 3 over gloo, fp32, the logits agree with TP = 1 to 1e-4
and greedy decoding is token-identical."""

import torch

from gpu.loader.decoder import default_model_path, load_model
from gpu.parallel import SINGLE
from tests.support.tp_ranks import greedy, logits, run_ranks

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
NEW_TOKENS = 8


def _run(tp, prompts, m=None):
    m = m or load_model(None, dtype="float32", progress=False, tp=tp).model
    assert (m.local_q_heads, m.local_kv_heads) == (9 // tp.size, 3 // tp.size)
    local_params = sum(p.numel() for p in m.parameters())
    return logits(m, prompts), [greedy(m, tp, ids, NEW_TOKENS) for ids in prompts[:2]], local_params


def test_tp3_matches_tp1():
    loaded = load_model(default_model_path(), dtype="float32", progress=False)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    want, want_tokens, all_params = _run(SINGLE, prompts, loaded.model)
    got, got_tokens, local_params = run_ranks(3, _run, prompts)
    assert local_params < all_params * 0.4  # a rank holds its third, plus the replicated norms
    assert got.shape == want.shape == (sum(map(len, prompts)), 49152)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got_tokens == want_tokens
