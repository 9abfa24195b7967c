"""The fused per-layer kernel (q/k RMSNorm + RoPE + KV-cache write) against the unfused
torch path, op for op."""
from __future__ import annotations

import pytest
import torch

from gpu.kernels.triton.qkv_prep import prepare_qkv, prepare_qkv_ref
from tests.support.qkv_inputs import _inputs

CASES = {
    # name: (T, Hq, Hkv, Dh, page, qk_norm)
    "qwen3_like_gqa2": (5, 4, 2, 64, 16, True),
    "odd_heads_d80_page7": (7, 6, 3, 80, 7, True),     # Dh/2 = 40: padded halves
    "llama_like_no_norm": (3, 8, 2, 32, 4, False),
    "mqa_one_token": (1, 5, 1, 16, 16, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_prepare_qkv_matches_unfused_path(case, dtype, device, tol):
    args = _inputs(*CASES[case], dtype, device)
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    q = prepare_qkv(*args)
    q_ref = prepare_qkv_ref(*ref_args)
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(args[9], ref_args[9], **tol(dtype))     # k cache, untouched slots too
    torch.testing.assert_close(args[10], ref_args[10], atol=0, rtol=0)  # v: copied exactly
    assert not torch.equal(args[9], _inputs(*CASES[case], dtype, device)[9])   # something was written


def test_prepare_qkv_model_end_to_end(tiny_qwen3_dir, device):
    """The tiny Qwen3 through the Triton attention backend with the fused kernel on and off:
    the same hidden states and cache (on CPU the model's other ops are torch's)."""
    from gpu.layers.attention import KVCache, TritonPagedAttention
    from gpu.loader.decoder import load_model
    from gpu.interface import SeqChunk
    from gpu.worker.staging import prepare_step

    lm = load_model(tiny_qwen3_dir, load_format="dummy", dtype="float32", device=device, progress=False).model
    c = lm.config
    outs = []
    for fused in (False, True):
        cache = KVCache(c.num_hidden_layers, 8, 16, c.num_key_value_heads, c.head_dim, lm.dtype, device)
        attn = TritonPagedAttention(cache, c.head_dim ** -0.5)
        attn.fused_qkv = fused
        chunks = (SeqChunk("a", (3, 5, 7, 11), 0, (0,), True), SeqChunk("b", (2, 4), 0, (1,), True))
        ids, pos, meta, _ = prepare_step(chunks, 16, torch.device(device))
        attn.prepare(meta)
        with torch.inference_mode():
            outs.append((lm(ids, pos, attn), cache.k[1].clone(), cache.v[1].clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
