"""Memory a sequence holds in a hybrid linear-attention model against attention-only ones,
from the configs (nothing allocated): Qwen3-Next-80B-A3B's state pool slot (36 Gated
DeltaNet layers' conv + recurrent state, gpu/layers/linear_attention.py StatePool) plus its
12 full-attention layers' K/V, against Qwen3-30B-A3B (48 layers of attention, its
published config) and against Qwen3-Next's own shape with every layer full attention.
bf16 K/V and conv state, fp32 recurrent state (as the engine keeps them).

    .venv/bin/python scripts/hybrid_memory.py
"""
from __future__ import annotations

import torch

from gpu.config.model import ModelConfig
from gpu.layers.attention import KVCache
from gpu.layers.linear_attention import StatePool
from gpu.models.qwen3_next import hybrid_fields

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json, the keys that size attention and state
QWEN3_NEXT_80B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
                      num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                      linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                      max_position_embeddings=262144, rope_theta=10000000, partial_rotary_factor=0.25)
# Qwen/Qwen3-30B-A3B: 48 layers, 4 KV heads of 128
QWEN3_30B = dict(layers=48, kv_heads=4, head_dim=128)
BF16 = torch.bfloat16


def kv_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int) -> int:
    return KVCache.bytes_per_block(layers, 1, kv_heads, head_dim, BF16) * tokens


def main() -> None:
    c = ModelConfig(**hybrid_fields(QWEN3_NEXT_80B, "qwen3_next", max_positions=262144))
    state = StatePool.bytes_per_slot(c, BF16)
    print(f"Qwen3-Next-80B-A3B: {c.num_linear_layers} linear layers, {c.num_kv_layers} full; "
          f"state a sequence {state / 2**20:.1f} MiB (= the K/V of "
          f"{state // kv_bytes(c.num_kv_layers, 2, 256, 1)} tokens of its full layers)")
    print("| tokens | Qwen3-Next-80B: state + K/V | same shape, all 48 layers attention | Qwen3-30B-A3B K/V |")
    print("|---|---|---|---|")
    for tokens in (4096, 32768):
        hybrid = state + kv_bytes(c.num_kv_layers, 2, 256, tokens)
        full = kv_bytes(c.num_hidden_layers, 2, 256, tokens)
        q30 = kv_bytes(QWEN3_30B["layers"], QWEN3_30B["kv_heads"], QWEN3_30B["head_dim"], tokens)
        print(f"| {tokens} | {hybrid / 2**20:.1f} MiB | {full / 2**20:.1f} MiB | {q30 / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
