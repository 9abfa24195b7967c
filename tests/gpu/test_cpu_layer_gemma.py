"""Gemma 3's decode stack in one C call (gpu/kernels/cpu/layer_gemma.c, issue 55) against the
per-layer torch path it replaces, both over the same packed (Q8_0) weights through ModelRunner:
a tiny random Gemma 3 checkpoint written as a GGUF (sliding window 6 on five layers of seven,
blocks of 4), prefilled past its window and decoded, then a verify step; in a plain cache and in
the hybrid one (the sliding layers in a pool of their own, slots moving as the window passes).
Logits within 1e-3 with the fp32 tiles (the attention's and GELU's sums round in another order),
within 5e-2 with an AVX2 build's int16 GEMV tiles (each linear's input rounded to int16 apart);
the same greedy tokens; and the real Gemma 3 270M Q4_K_M file's first decode steps the same way."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gpu.formats.gguf import _GEMMA_BLOCK
from gpu.interface import SamplingOptions, SeqChunk, SeqStart, StepPlan
from gpu.kernels.cpu import layer_gemma
from gpu.kernels.cpu import quant as cpu_quant
from gpu.layers.attention import KVCache
from gpu.loader.decoder import load_model
from gpu.worker.runner import ModelRunner
from tests.support.cpu_layer_runs import _Counting
from tests.support.cpu_layer_runs import _run as _run_seqs
from tests.support.gguf_writing import _finish, _gguf_name, _spm_vocab, _writer
from tests.support.hf_models import make_hf_model

pytestmark = pytest.mark.skipif(layer_gemma.library() is None, reason="gpu/kernels/cpu/layer_gemma.c is not built")

IDS = [2, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101, 11, 12]
TABLE = (9, 2, 7, 0, 11, 4, 5)
GEMMA3_GGUF = Path(os.environ.get("TAILRACE_GEMMA3_GGUF")
                   or Path(sys.prefix) / "share" / "tailrace" / "gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A tiny random Gemma 3 (7 layers: 0-4 sliding with window 6 at base 1e4, 5 global at 1e6,
    6 sliding) as a GGUF with Q8_0 linears and embedding, loaded packed."""
    hf = make_hf_model("gemma3", vocab_size=400, head_dim=16, query_pre_attn_scalar=16, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    c = hf.config
    path = tmp_path_factory.mktemp("gemma3c") / "tiny-gemma3-q8_0.gguf"
    w = _writer(path, "gemma3", c)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(c.sliding_window)
    tokens, types = _spm_vocab(c.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(types)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        data = t.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            w.add_tensor(_gguf_name(name, _GEMMA_BLOCK), data + 1.0)
        else:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(name, _GEMMA_BLOCK), q, raw_shape=q.shape,
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    _finish(w)
    model = load_model(path, progress=False).model
    assert isinstance(model.fused_decode, layer_gemma.GemmaDecode)
    assert [model.config.layer_window(i) for i in range(7)] == [6] * 5 + [None, 6]
    return model


def _plans(hybrid: bool):
    """22 tokens prefilled in two chunks, three decode steps, a verify of four rows (block
    size 4, window 6: blocks 9 and 2 are passed by step 3, their sliding slots reused)."""
    upd = (lambda *u: u) if hybrid else (lambda *u: ())
    g = SamplingOptions(temperature=0.0)
    return [
        StepPlan(1, (SeqChunk("a", tuple(IDS[:10]), 0, TABLE[:3], False),), (SeqStart("a", tuple(IDS), g),),
                 kv_updates=upd((9, 0), (2, 1), (7, 2))),
        StepPlan(2, (SeqChunk("a", tuple(IDS[10:19]), 10, TABLE[:5], True),), kv_updates=upd((0, 3), (11, 4))),
        StepPlan(3, (SeqChunk("a", (IDS[19],), 19, TABLE[:6], True),), kv_updates=upd((9, -1), (2, -1), (4, 0))),
        StepPlan(4, (SeqChunk("a", (IDS[20],), 20, TABLE[:6], True),)),
        StepPlan(5, (SeqChunk("a", (IDS[21],), 21, TABLE[:6], True),), kv_updates=upd((7, -1), (5, 1))),
        StepPlan(6, (SeqChunk("a", (40, 11, 12, 13), 22, TABLE, True, num_drafts=3),)),
    ]


def _run(lm, cache, hybrid: bool, fused: bool):
    """(the logits of every step after the prefill, the greedy tokens of each)."""
    lm.fused_decode.enabled = fused
    runner = ModelRunner(lm, cache, device=torch.device("cpu"))
    seen, tokens = [], []
    orig = lm.compute_logits
    lm.compute_logits = lambda h: seen.append(orig(h)) or seen[-1]
    try:
        for plan in _plans(hybrid):
            tokens.append(runner.execute(plan).token_ids)
    finally:
        del lm.compute_logits
        lm.fused_decode.enabled = True
    return seen[2:], tokens[2:]


def _set_int16_gemv(max_m: int) -> bool:
    """The int16 GEMV tiles' most rows in both libraries (the Gemma stack's, and the torch
    path's PackedLinears'): -1 the default, 0 none; whether the Gemma stack's build has them."""
    if cpu_quant.kernels() is not None:
        cpu_quant.kernels().set_int16_gemv(max_m)
    return bool(layer_gemma.library().cpu_quant_set_int16_gemv(max_m))


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain-cache", "sliding-pool"])
def test_gemma_stack_matches_the_torch_path(lm, hybrid, monkeypatch):
    c = lm.config
    counting = _Counting(lm.fused_decode._fn)
    monkeypatch.setattr(lm.fused_decode, "_fn", counting)
    shape = (c.num_hidden_layers, 12, 4, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
    sliding = {"sliding_layers": (0, 1, 2, 3, 4, 6), "num_sliding_blocks": 5} if hybrid else {}
    try:
        for int16, tol in ((False, 1e-3), (True, 5e-2)):
            if int16 and not _set_int16_gemv(-1):
                continue            # no int16 GEMV tiles in this build (AVX-512: the fp32 tiles at 1 row)
            if not int16:
                _set_int16_gemv(0)
            counting.rcs.clear()
            got, got_tokens = _run(lm, KVCache(*shape, **sliding), hybrid, True)
            assert counting.rcs == [0] * 4     # the decode steps and the verify, none of the prefills
            want, want_tokens = _run(lm, KVCache(*shape, **sliding), hybrid, False)
            assert got_tokens == want_tokens
            assert got[-1].shape[0] == 4
            err = max((a - b).abs().max().item() for a, b in zip(got, want))
            print(f"int16 {int16}: max |logits - torch path's| {err:.2e}")
            assert err < tol, (int16, err)
    finally:
        _set_int16_gemv(-1)


def test_three_sequences_on_two_threads(lm, monkeypatch):
    """Three sequences decoding together (prompts of 3, 7 and 11 tokens, some past the window)
    with two OpenMP threads (the stack's barriers, the GeGLU split by columns): the same tokens
    as the torch path, logits within 1e-3 (fp32 tiles)."""
    counting = _Counting(lm.fused_decode._fn)
    monkeypatch.setattr(lm.fused_decode, "_fn", counting)
    torch.set_num_threads(2)
    _set_int16_gemv(0)
    try:
        got_tokens, got, _ = _run_seqs(lm, True, 3, steps=3)
        assert counting.rcs == [0] * 3
        want_tokens, want, _ = _run_seqs(lm, False, 3, steps=3)
    finally:
        _set_int16_gemv(-1)
    assert got_tokens == want_tokens
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-3


@pytest.mark.skipif(not GEMMA3_GGUF.is_file(), reason=f"{GEMMA3_GGUF} is absent (`make install-dev`)")
def test_real_gemma3_270m_decode_steps_match_the_torch_path(monkeypatch):
    """The real file (Q4_K, Q6_K, Q5_0 held as Q8_0; head_dim 256, one KV head, window 512):
    a prompt and four greedy decode steps, the C stack against the per-layer torch path, both
    with the build's default tiles: the same tokens, logits (magnitude ~20-40) within 0.1. The
    file's 262k-piece vocabulary is not read (20+ s of the load on this machine): token ids only."""
    from gpu.formats.gguf import GGUFFile
    monkeypatch.setattr(GGUFFile, "tokenizer", lambda self: None)
    lm = load_model(GEMMA3_GGUF, progress=False).model
    assert isinstance(lm.fused_decode, layer_gemma.GemmaDecode)
    counting = _Counting(lm.fused_decode._fn)
    monkeypatch.setattr(lm.fused_decode, "_fn", counting)
    c = lm.config
    prompt = (2, 818, 5279, 529, 7001, 563)     # <bos> and five ordinary tokens
    g = SamplingOptions(temperature=0.0)

    def run(fused: bool):
        lm.fused_decode.enabled = fused
        cache = KVCache(c.num_hidden_layers, 4, 16, c.num_key_value_heads, c.head_dim, torch.float32, "cpu")
        runner = ModelRunner(lm, cache, device=torch.device("cpu"))
        seen = []
        orig = lm.compute_logits
        lm.compute_logits = lambda h: seen.append(orig(h)) or seen[-1]
        try:
            res = runner.execute(StepPlan(0, (SeqChunk("a", prompt, 0, (0, 1), True),), (SeqStart("a", prompt, g),)))
            tokens = [res.token_ids[0]]
            for step in range(1, 5):
                res = runner.execute(StepPlan(step, (SeqChunk("a", (tokens[-1],), len(prompt) + step - 1, (0, 1),
                                                              True),)))
                tokens.append(res.token_ids[0])
        finally:
            del lm.compute_logits
            lm.fused_decode.enabled = True
        return tokens, seen[1:]

    got_tokens, got = run(True)
    assert counting.rcs == [0] * 4
    want_tokens, want = run(False)
    assert got_tokens == want_tokens
    err = max((a - b).abs().max().item() for a, b in zip(got, want))
    assert err < 0.1, err
