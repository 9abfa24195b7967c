"""Random-weight EAGLE heads written in the published formats (as vLLM's tests use random
heads, e.g. eagle618/eagle-deepseek-v3-random): the EAGLE3 folder (LlamaForCausalLMEagle3,
midlayer.*, fc over three aux states, norm, its own lm_head over a draft vocabulary, d2t and
t2d), the speculators format (speculators_config, transformer_layer_config, layers.0.*), and
EAGLE-1 (fc over [embedding; hidden], layers.0.*, the target's embeddings and LM head)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _layer(prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
           qkv_in: int, g: torch.Generator, scale: float) -> dict[str, torch.Tensor]:
    def w(*shape):
        return torch.randn(*shape, generator=g) * scale

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)
    return {
        f"{prefix}.self_attn.q_proj.weight": w(heads * head_dim, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": w(kv_heads * head_dim, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": w(kv_heads * head_dim, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        f"{prefix}.mlp.gate_proj.weight": w(inter, hidden),
        f"{prefix}.mlp.up_proj.weight": w(inter, hidden),
        f"{prefix}.mlp.down_proj.weight": w(hidden, inter),
        f"{prefix}.input_layernorm.weight": norm(hidden),
        f"{prefix}.post_attention_layernorm.weight": norm(hidden),
    }


def layer_config(vocab: int, hidden: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                 inter: int = 128) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 1,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "hidden_act": "silu", "tie_word_embeddings": False}


def eagle3_head(out: Path, *, vocab: int, target_hidden: int, hidden: int = 64,
                draft_vocab: int = 2048, speculators: bool = False, aux_ids=None,
                seed: int = 0, scale: float = 0.05, own_embeddings: bool = True,
                **layer_kw) -> Path:
    """A random EAGLE3 head for a target of `vocab` tokens and width `target_hidden`:
    `draft_vocab` draft tokens mapped by d2t to a random subset of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    lc = layer_config(vocab, hidden, **layer_kw)
    heads, kvh, hd, inter = (lc["num_attention_heads"], lc["num_key_value_heads"],
                             lc["head_dim"], lc["intermediate_size"])
    prefix = "layers.0" if speculators else "midlayer"
    t = _layer(prefix, hidden, heads, kvh, hd, inter, 2 * hidden, g, scale)
    t[f"{prefix}.hidden_norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    n_aux = 3
    t["fc.weight"] = torch.randn(hidden, n_aux * target_hidden, generator=g) * scale
    t["norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    t["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=g) * scale * 4
    if own_embeddings:
        t["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g) * scale * 4
    targets = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    t["d2t"] = targets - torch.arange(draft_vocab)           # target id = draft id + d2t
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    t["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    if speculators:
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "speculators_version": "0.1.0", "transformer_layer_config": lc,
               "draft_vocab_size": draft_vocab, "target_hidden_size": target_hidden,
               "norm_before_residual": True,
               "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                      "proposal_methods": [{"proposal_type": "greedy",
                                                            "speculative_tokens": 3}],
                                      "verifier": {"name_or_path": "target",
                                                   "architectures": ["LlamaForCausalLM"]}}}
    else:
        cfg = {**lc, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab,
               "target_hidden_size": target_hidden}
    if aux_ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def eagle_head(out: Path, *, vocab: int, hidden: int, seed: int = 0, scale: float = 0.05,
               fc_bias: bool = True, **layer_kw) -> Path:
    """A random EAGLE-1 head (yuhuili/EAGLE's layout): fc over [embedding; hidden], one
    Llama layer (its input_layernorm unused), no embeddings (the target's are shared)."""
    g = torch.Generator().manual_seed(seed)
    lc = layer_config(vocab, hidden, **layer_kw)
    t = _layer("layers.0", hidden, lc["num_attention_heads"], lc["num_key_value_heads"],
               lc["head_dim"], lc["intermediate_size"], hidden, g, scale)
    del t["layers.0.input_layernorm.weight"]
    t["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * scale
    if fc_bias:
        t["fc.bias"] = torch.randn(hidden, generator=g) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**lc, "architectures": ["EagleLlamaForCausalLM"]}))
    return out
