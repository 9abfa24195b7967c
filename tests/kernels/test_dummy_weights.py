"""Dummy weights (gpu/loader/decoder.py, --load-format dummy) on the kernel tests' device: drawn on a
CUDA model's own GPU, on the CPU otherwise; the same seed gives the same model, another seed
another, and a bf16 model is the fp32 one rounded (scripts/compare_paths.py's reference is
the fp32 model on the same weights)."""
from __future__ import annotations

import torch

from gpu.loader.decoder import draw_device, load_model


def _load(path, device, dtype="float32", seed=0):
    return load_model(path, load_format="dummy", dtype=dtype, device=device, seed=seed, progress=False).model


def test_dummy_weights_are_drawn_where_the_model_is(tiny_qwen3_dir, device):
    a, b, c = _load(tiny_qwen3_dir, device), _load(tiny_qwen3_dir, device), _load(tiny_qwen3_dir, device, seed=1)
    assert draw_device(a).type == device
    assert all(p.device.type == device for p in a.parameters())
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    w = "layers.0.self_attn.qkv_proj.weight"
    assert not torch.equal(pa[w], pc[w])
    assert 0.015 < pa[w].std().item() < 0.025 and pa["layers.0.input_layernorm.weight"].eq(1).all()


def test_a_bf16_dummy_model_is_the_fp32_one_rounded(tiny_qwen3_dir, device):
    f32, bf16 = _load(tiny_qwen3_dir, device), _load(tiny_qwen3_dir, device, dtype="bfloat16")
    for (name, p), q in zip(f32.named_parameters(), bf16.parameters()):
        assert torch.equal(p.to(torch.bfloat16), q), name


def test_meta_models_draw_on_the_cpu(tiny_qwen3_dir):
    assert draw_device(_load(tiny_qwen3_dir, "meta")) == torch.device("cpu")
