"""Tiny random HF reference models (Llama, Qwen, gpt-oss ... at test scale) made with transformers,
saved as HF folders or not, and their logits: HF's and ours (for tests/gpu, and the engine,
LoRA and TP tests that need a checkpoint of a given architecture)."""

from pathlib import Path

import torch

from gpu.layers.attention_dense import DenseCausalAttention

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1)

# gpt-oss at test scale: 4 experts top-2, a sliding window of 6 on layers 0 and 2 (so it cuts
# in within a short prompt), yarn RoPE with gpt-oss's settings at a smaller original length.
TINY_GPT_OSS = dict(num_hidden_layers=3, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=6, rms_norm_eps=1e-5, rope_parameters={
                        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})

# Gemma at test scale: a window of 6 (cut in within a short prompt), head_dim 16 (not 256),
# query_pre_attn_scalar apart from head_dim. Gemma 2: soft caps low enough to bite on random
# weights; Gemma 3: 7 layers (the 5:1 pattern and one more), linear RoPE scaling on the global
# layers and a local base of its own on the sliding ones.
TINY_GEMMA2 = dict(num_hidden_layers=3, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                   attn_logit_softcapping=0.5, final_logit_softcapping=2.0)
TINY_GEMMA3 = dict(num_hidden_layers=7, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})

# Gemma 4 at test scale: every layer type and the shared-KV case in 4 layers (sliding, full,
# then two layers reading layers 0 and 1's KV, their MLPs double-wide), the full layers with
# a head_dim and KV heads of their own and k = v, per-layer inputs of 8, a 512 vocabulary
TINY_GEMMA4 = dict(vocab_size=512, vocab_size_per_layer_input=512, num_hidden_layers=4, head_dim=16,
                   global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=6,
                   layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                   use_double_wide_mlp=True, hidden_size_per_layer_input=8, final_logit_softcapping=3.0,
                   pad_token_id=0, eos_token_id=1, bos_token_id=2)


# its MoE variant (26B-A4B's layout): 4 experts, top 2, beside every layer's dense MLP
TINY_GEMMA4_MOE = dict(TINY_GEMMA4, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


def make_hf_model(arch: str, out_dir: Path | None = None, seed: int = 0, **overrides):
    """A tiny random transformers model (eager attention, fp32). Norm weights and biases are
    perturbed away from their 1/0 init so that loading them wrongly shows in the logits."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config, "gpt_oss": transformers.GptOssConfig,
                  "gemma2": transformers.Gemma2Config, "gemma3": transformers.Gemma3TextConfig,
                  "mistral": transformers.MistralConfig, "phi3": transformers.Phi3Config,
                  "gemma4": transformers.Gemma4TextConfig,
                  "gemma4_moe": transformers.Gemma4TextConfig}[arch]
    family = {"gpt_oss": TINY_GPT_OSS, "gemma2": TINY_GEMMA2, "gemma3": TINY_GEMMA3, "gemma4": TINY_GEMMA4,
              "gemma4_moe": TINY_GEMMA4_MOE,
              "phi3": dict(pad_token_id=0, eos_token_id=2, bos_token_id=1)}.get(arch, {})
    config = config_cls(**{**TINY, **family, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith(("router.scale", "per_expert_scale")):
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):     # Gemma 4's, loaded: away from its 1
                b.uniform_(0.5, 1.5)
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()  # [T, V]


def our_logits(model, ids: list[int], seq_lens: list[int] | None = None) -> torch.Tensor:
    """[T, V] logits through the dense (cache-free) attention backend; positions restart per sequence."""
    lens = seq_lens or [len(ids)]
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        hidden = model(torch.tensor(ids, dtype=torch.int64), positions, DenseCausalAttention(seq_lens))
        return model.compute_logits(hidden)
