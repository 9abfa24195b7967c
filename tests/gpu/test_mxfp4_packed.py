"""Packed MXFP4 experts (gpu/layers/moe.py PackedExperts): the tiny gpt-oss checkpoint loaded packed
gives the logits of the same checkpoint dequantised, through the Triton grouped GEMM (forced on
CPU, under the interpreter) and through the per-call dequantising fallback."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu.models.registry import config_from_hf
from gpu.quantization import mxfp4
from gpu.loader.decoder import load_model
from gpu.layers.moe import Experts, PackedExperts
from tests.support.hf_models import make_hf_model, our_logits

IDS = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88, 130, 1, 64, 9, 33, 120, 77, 2, 45, 101]


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    """A tiny gpt-oss checkpoint whose experts are stored as MXFP4, as openai/gpt-oss-* ship them."""
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    make_hf_model("gpt_oss", path, seed=3)
    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(weights.pop(name).transpose(1, 2))      # [E, out, in/32, 16]
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
    save_file(weights, path / "model.safetensors")
    return path


def _load(path, experts):
    return load_model(path, dtype="float32", progress=False, experts=experts).model


def test_packed_experts_stay_packed(mxfp4_dir):
    packed, dense = _load(mxfp4_dir, "packed"), _load(mxfp4_dir, "dequantized")
    ex = packed.layers[0].mlp.experts
    assert isinstance(ex, PackedExperts) and isinstance(dense.layers[0].mlp.experts, Experts)
    assert ex.gate_up_proj_blocks.dtype == torch.uint8 and tuple(ex.gate_up_proj_blocks.shape) == (4, 192, 32)
    assert tuple(ex.gate_up_proj_scales.shape) == (4, 192, 2) and tuple(ex.down_proj_blocks.shape) == (4, 64, 48)
    assert not ex.use_kernel                                   # CPU: the kernel only when asked
    # the packed weights are the checkpoint's bytes
    torch.testing.assert_close(mxfp4.dequantize_packed(ex.down_proj_blocks, ex.down_proj_scales, torch.float32),
                               dense.layers[0].mlp.experts.down_proj, rtol=0, atol=0)
    packed_bytes = sum(p.numel() for n, p in packed.named_parameters() if n.endswith(("_blocks", "_scales")))
    dense_elements = sum(p.numel() for n, p in dense.named_parameters() if n.endswith(("experts.gate_up_proj",
                                                                                     "experts.down_proj")))
    assert packed_bytes * 8 == dense_elements * 4.25           # 4 bits an element + 8 bits per 32


def test_auto_packs_only_on_cuda(mxfp4_dir):
    assert isinstance(_load(mxfp4_dir, "auto").layers[0].mlp.experts, Experts)      # CPU: dequantised
    with pytest.raises(ValueError, match="unsupported experts"):
        _load(mxfp4_dir, "bogus")


def test_packed_fallback_gives_the_dequantised_logits(mxfp4_dir):
    dense = our_logits(_load(mxfp4_dir, "dequantized"), IDS)
    torch.testing.assert_close(our_logits(_load(mxfp4_dir, "packed"), IDS), dense, rtol=0, atol=0)


def test_packed_kernel_gives_the_dequantised_logits(mxfp4_dir):
    """The Triton grouped GEMM (on CPU under the interpreter, fp32 dots): the same logits up to
    accumulation order."""
    packed = _load(mxfp4_dir, "packed")
    for layer in packed.layers:
        layer.mlp.experts.use_kernel = True
    calls = []
    from gpu.kernels.triton import mxfp4_moe
    orig = mxfp4_moe.mxfp4_moe_matmul

    def counting(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    mxfp4_moe.mxfp4_moe_matmul = counting
    try:
        got = our_logits(packed, IDS)
    finally:
        mxfp4_moe.mxfp4_moe_matmul = orig
    assert len(calls) == 2 * 3                                 # gate/up and down, 3 layers
    dense = our_logits(_load(mxfp4_dir, "dequantized"), IDS)
    torch.testing.assert_close(got, dense, atol=1e-4, rtol=1e-4)


def test_dummy_packed_load_draws_finite_weights(mxfp4_dir):
    lm = load_model(mxfp4_dir, load_format="dummy", dtype="float32", progress=False, experts="packed").model
    w = mxfp4.dequantize_packed(lm.layers[1].mlp.experts.gate_up_proj_blocks,
                                lm.layers[1].mlp.experts.gate_up_proj_scales, torch.float32)
    assert 0.005 < w.std() < 0.03 and w.abs().max() <= 6 * 2.0 ** -8
    assert torch.isfinite(our_logits(lm, IDS)).all()


def test_gpt_oss_20b_weight_memory_packed_against_dequantised():
    """The real config on the meta device (nothing allocated): what a CUDA load holds."""
    import json
    from pathlib import Path

    import gpu
    from gpu.config.model import ModelConfig
    from gpu.models.causal_lm import CausalLM

    c = config_from_hf(json.loads((Path(gpu.__file__).parent / "configs/gpt-oss-20b/config.json").read_text()))

    def held(packed):
        lm = CausalLM(c, torch.bfloat16, "meta", packed_experts=packed, max_positions=16)
        return sum(p.numel() * p.element_size() for p in lm.parameters())

    dense, packed = held(False), held(True)
    experts = c.num_hidden_layers * c.num_experts * 3 * c.hidden_size * c.intermediate_size   # elements
    assert dense - packed == experts * 2 - experts * 4.25 / 8
    assert round(dense / 1e9, 1) == 41.8 and round(packed / 1e9, 1) == 13.8
