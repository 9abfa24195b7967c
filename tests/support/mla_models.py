"""Tiny DeepSeek-V3 latent-attention layers (moved from tests/gpu/test_mla.py, which other test
modules share)."""
from __future__ import annotations

import torch
from gpu.layers.mla import LatentAttention
from gpu.models.registry import config_from_hf
from tests.support.moe_models import BASE, MOE


def _tiny_config():
    import transformers

    cls, kw = MOE["deepseek_v3"]
    d = getattr(transformers, cls)(**{**BASE, **kw}).to_dict()
    return config_from_hf({**d, "architectures": ["DeepseekV3ForCausalLM"]})


def _layer(c, seed=0):
    g = torch.Generator().manual_seed(seed)
    attn = LatentAttention(c, 0, torch.float32, "cpu")
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) * 0.3)
    return attn
