"""A decode step's cost on the CPU: a hybrid model (Qwen3.5's layout: 3 Gated DeltaNet
layers to 1 gated full-attention one) against a dense Qwen3 of the same width, depth and
attention heads, at 1 and 32 sequences of 256 tokens of context. Random weights (fp32),
the paged torch backend and the runner's StatePool, one forward a step (no sampling);
the median of 20 steps after 3 to warm up, side by side in one process.

    .venv/bin/python scripts/bench_hybrid_decode.py [--threads N]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu.config.model import ModelConfig
from gpu.interface import SeqChunk
from gpu.layers.attention import KVCache, TorchPagedAttention
from gpu.layers.linear_attention import LinearDims, StatePool
from gpu.models.causal_lm import CausalLM
from gpu.models.qwen3_5 import Model as Qwen35
from gpu.worker.staging import prepare_step

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
             rope_theta=1e6, max_position_embeddings=4096)
LINEAR = dict(layer_types=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3
              + ("full_attention",), partial_rotary_factor=0.25, attn_output_gate=True,
              linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4)
CONTEXT, BLOCK = 256, 16


def random_(model: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.1))
    return model.eval()


def step_ms(model, config: ModelConfig, seqs: int) -> float:
    per_seq = CONTEXT // BLOCK + 1
    cache = KVCache(config.num_kv_layers, seqs * per_seq, BLOCK, config.num_key_value_heads,
                    config.head_dim, torch.float32, "cpu")
    attn = TorchPagedAttention(cache, config.head_dim ** -0.5)
    chunks = tuple(SeqChunk(f"s{i}", (5,), CONTEXT, tuple(range(i * per_seq, (i + 1) * per_seq)), True,
                            state_slot=i) for i in range(seqs))
    pool = (StatePool(config.num_linear_layers, seqs, LinearDims.of(config), torch.float32, "cpu")
            if config.num_linear_layers else None)
    times = []
    with torch.inference_mode():
        for k in range(23):
            t0 = time.perf_counter()
            ids, pos, meta, _ = prepare_step(chunks, BLOCK, torch.device("cpu"))
            if pool is not None:
                meta.states = pool.step([c.state_slot for c in chunks], meta.q_starts, meta.q_lens,
                                        meta.start_positions)
            attn.prepare(meta)
            model.compute_logits(model(ids, pos, attn))
            if k >= 3:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dense_cfg = ModelConfig(architecture="qwen3", qk_norm=True, **SHAPE)
    hybrid_cfg = ModelConfig(architecture="qwen3_5", **SHAPE, **LINEAR)
    dense, hybrid = random_(CausalLM(dense_cfg)), random_(Qwen35(hybrid_cfg))
    print(f"threads {torch.get_num_threads()}; context {CONTEXT}")
    print("| sequences | dense Qwen3 (ms a step) | hybrid Qwen3.5 layout (ms a step) |")
    print("|---|---|---|")
    for seqs in (1, 32):
        print(f"| {seqs} | {step_ms(dense, dense_cfg, seqs):.1f} | {step_ms(hybrid, hybrid_cfg, seqs):.1f} |")


if __name__ == "__main__":
    main()
