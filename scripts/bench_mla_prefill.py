"""One MLA layer's prefill on the CPU, the latent expanded (the default) against absorbed
(`expand_prefill = False`): DeepSeek-V3's per-head shapes (kv_lora_rank 512, d_n 128, d_r 64,
d_v 128, q_lora_rank 1536), hidden and heads cut down, random weights, fp32. Prints the best
of --repeats, in ms.

    .venv/bin/python scripts/bench_mla_prefill.py --tokens 256 1024 --heads 16
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from gpu.config.model import ModelConfig
from gpu.interface import SeqChunk
from gpu.layers.attention import KVCache, TorchPagedAttention
from gpu.layers.mla import LatentAttention
from gpu.layers.ops import build_rope_cache
from gpu.models.registry import config_from_hf
from gpu.worker.staging import prepare_step


def config(heads: int, hidden: int) -> ModelConfig:
    return config_from_hf({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                           "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
                           "num_hidden_layers": 1, "intermediate_size": 256, "moe_intermediate_size": 64,
                           "vocab_size": 512, "q_lora_rank": 1536, "kv_lora_rank": 512,
                           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                           "max_position_embeddings": 8192, "n_routed_experts": 4, "num_experts_per_tok": 2})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    c = config(args.heads, args.hidden)
    attn = LatentAttention(c, 0, torch.float32, "cpu")
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.02 if p.dim() > 1 else torch.ones_like(p))
    bs = 16
    cos_sin = build_rope_cache(c, max(args.tokens), "cpu")
    for T in args.tokens:
        x = torch.randn(T, c.hidden_size)
        nblk = -(-T // bs)
        cache = KVCache(1, nblk, bs, 1, c.kv_cache_head_dim, torch.float32, "cpu", latent=c.kv_cache_latent)
        backend = TorchPagedAttention(cache, c.head_dim ** -0.5)
        _, positions, meta, _ = prepare_step((SeqChunk("a", tuple(range(T)), 0, tuple(range(nblk)), True),),
                                             bs, torch.device("cpu"))
        times = {}
        for expand in (True, False):
            attn.expand_prefill = expand
            best = float("inf")
            with torch.inference_mode():
                for _ in range(args.repeats):
                    backend.prepare(meta)
                    t = time.perf_counter()
                    attn(x, positions, cos_sin, backend)
                    best = min(best, time.perf_counter() - t)
            times[expand] = best
        print(f"{T} tokens, {args.heads} heads: expanded {times[True] * 1e3:.1f} ms, absorbed "
              f"{times[False] * 1e3:.1f} ms ({times[False] / times[True]:.2f}x)")


if __name__ == "__main__":
    main()
