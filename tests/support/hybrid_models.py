"""Tiny random Qwen3-Next / Qwen3.5 checkpoints made with transformers, for tests/gpu and
tests/engine (the hybrid linear-attention models, issue 57)."""
import torch

TINY_HYBRID = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
                   rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False)


# the mixtures' experts: 4 of 32 columns, 2 a token, a shared expert of 48
TINY_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)


def _modeling_without_fla() -> None:
    """transformers' Qwen3-Next / Qwen3.5 modeling modules imported with flash-linear-attention
    hidden: their kernel decorators import fla (about 30 s of Triton parsing on this CPU) only
    to fall back to the torch path for CPU tensors anyway. Nothing changes where fla is
    already imported."""
    import importlib
    import sys

    if "fla" in sys.modules:
        return
    sys.modules["fla"] = None       # import fla -> ImportError -> the torch functions
    try:
        for name in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    finally:
        del sys.modules["fla"]


def make_hybrid(family: str, out_dir=None, seed: int = 0, **overrides):
    """A tiny random transformers Qwen3-Next (no experts unless overrides give num_experts),
    Qwen3.5 or Qwen3.5-MoE text model, eager, fp32, layers [linear, linear, linear, full];
    every norm, A_log and dt_bias perturbed."""
    import transformers

    _modeling_without_fla()
    cfg = {**TINY_HYBRID, **overrides}
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(**{"num_experts": 0, **cfg})
    elif family == "qwen3_5_moe":
        cfg.pop("intermediate_size")
        config = transformers.Qwen3_5MoeTextConfig(**{**TINY_EXPERTS, **cfg})
    else:
        config = transformers.Qwen3_5TextConfig(**cfg)
    rope = dict(config.rope_parameters)
    rope["partial_rotary_factor"] = 0.5       # 8 of 16 dims rotated
    config.rope_parameters = rope
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
    return model


def make_hybrid_vl(family: str, out_dir, seed: int = 0):
    """A tiny random Qwen3.5 (or, family "qwen3_5_moe", Qwen3.5-MoE) ForConditionalGeneration
    as the checkpoints are released: the text model under model.language_model, a one-block
    vision tower under model.visual, the config's decoder under text_config."""
    import transformers

    _modeling_without_fla()
    text = dict(TINY_HYBRID)
    if family == "qwen3_5_moe":
        text.pop("intermediate_size")
        text.update(TINY_EXPERTS)
    cls = transformers.Qwen3_5MoeConfig if family == "qwen3_5_moe" else transformers.Qwen3_5Config
    config = cls(text_config=text, vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                      intermediate_size=64, out_hidden_size=64))
    config.text_config.rope_parameters = {**config.text_config.rope_parameters, "partial_rotary_factor": 0.5}
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model
