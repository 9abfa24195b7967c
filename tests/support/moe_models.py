"""Tiny random mixture-of-experts checkpoints made with transformers (the families of
gpu/models/{qwen3_moe,qwen2_moe,mixtral}.py), perturbed as tests.support.hf_models.make_hf_model's."""
from __future__ import annotations

from pathlib import Path

import torch

# 8 experts top-2 of intermediate 32, a dense layer of 96 where a family has one; hidden 64,
# 4 query heads over 2 KV heads of 16, a 160-token vocabulary
BASE = dict(vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
            num_experts_per_tok=2)
MOE = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                                         num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen3_moe_unnormed": ("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                                                  norm_topk_prob=False)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                                         shared_expert_intermediate_size=48, decoder_sparse_step=2,
                                         num_hidden_layers=3)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, intermediate_size=32)),
    # MLA (latent 32 + rotary 16 cached a token, q of rank 48), grouped sigmoid routing, a shared
    # expert, a dense first layer, YaRN with mscale / mscale_all_dim
    "deepseek_v3": ("DeepseekV3Config", dict(
        n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, num_hidden_layers=3, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, num_key_value_heads=4,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9,
                         "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 64})),
    # partial rotary (half of 16), q/k/v biases, q/k norms, grouped sigmoid routing, a shared
    # expert, a dense first layer
    "glm4_moe": ("Glm4MoeConfig", dict(
        n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96, num_hidden_layers=3, n_group=2,
        topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5, attention_bias=True, use_qk_norm=True)),
    # RoPE on layers 0-2 (q/k norms), none on layer 3 (temperature from position 3 on, floor_scale
    # 4), top-1 of 4 experts on layers 1 and 3 with a shared expert, dense MLPs of 96 elsewhere
    "llama4": ("Llama4TextConfig", dict(
        num_local_experts=4, num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=96,
        num_hidden_layers=4, interleave_moe_layer_step=2, floor_scale=4, attn_scale=0.5,
        attention_chunk_size=128, max_position_embeddings=256)),
}


def make_moe_model(kind: str, out_dir: Path | None = None, seed: int = 0, **overrides):
    """A tiny random transformers MoE model (eager attention, fp32), saved to out_dir if given.
    Norm weights and biases are perturbed from their 1/0 init; routers are scaled up so that
    routing varies from token to token."""
    import transformers

    cls, kw = MOE[kind]
    config = getattr(transformers, cls)(**{**BASE, **kw, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "feed_forward.router.weight")):
                p.mul_(5.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
    return model
