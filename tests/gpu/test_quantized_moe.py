"""Mixture-of-experts checkpoints whose experts are pre-quantized (issue 58): a tiny random
Qwen3-MoE with every expert's gate/up/down (per-expert names, as Qwen3-30B-A3B-FP8 and the
W4A16 builds write them) and the attention linears in FP8 128x128 blocks or compressed-tensors
W4A16; the experts are dequantized at load, stacked, and the logits are those of transformers'
model holding the format's reference weights (fp32, 1e-4)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from gpu.loader.decoder import load_model
from tests.support.hf_models import hf_logits, our_logits
from tests.support.moe_models import make_moe_model
from tests.support.quantized_checkpoints import QUANT_CONFIGS, _quantize, fp32_tiles  # noqa: F401 (fp32_tiles: a fixture)

pytestmark = pytest.mark.usefixtures("fp32_tiles")  # fp32 GEMM tiles: the tests check products exactly

IDS = [3, 17, 42, 99, 5, 150, 7, 63, 21, 88]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _write_quantized_moe(fmt: str, path):
    """The transformers model (its weights replaced by the format's reference) and `path`
    holding the quantized checkpoint, experts written one linear each."""
    hf = make_moe_model("qwen3_moe", seed=3)
    qc, gen = QUANT_CONFIGS[fmt], torch.Generator().manual_seed(4)
    out: dict[str, torch.Tensor] = {}

    def put(prefix, w):
        tensors, ref = _quantize(fmt, qc, w, gen)
        out.update({f"{prefix}.{k}": t.contiguous() for k, t in tensors.items()})
        return ref

    with torch.no_grad():
        for name, p in hf.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            if leaf == "weight" and prefix.rsplit(".", 1)[-1] in ATTENTION:
                p.copy_(put(prefix, p.detach()))
            elif leaf == "gate_up_proj":                          # [E, 2I, D]: gate rows, then up rows
                inter = p.shape[1] // 2
                for e in range(p.shape[0]):
                    p[e, :inter] = put(f"{prefix}.{e}.gate_proj", p[e, :inter].clone())
                    p[e, inter:] = put(f"{prefix}.{e}.up_proj", p[e, inter:].clone())
            elif leaf == "down_proj":                             # [E, D, I]
                for e in range(p.shape[0]):
                    p[e] = put(f"{prefix}.{e}.down_proj", p[e].clone())
            else:
                out[name] = p.detach().clone().contiguous()
    path.mkdir()
    save_file(out, str(path / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    return hf


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-w4a16"])
def test_quantized_experts_are_dequantized_at_load(fmt, tmp_path):
    hf = _write_quantized_moe(fmt, tmp_path / fmt)
    loaded = load_model(tmp_path / fmt, dtype="float32", progress=False)
    assert "linears dequantized once at load" in loaded.weights or "decoder linears repacked" in loaded.weights
    ours = loaded.model.layers[0].mlp.experts.gate_up_proj         # [E, 2I, D], gate row 2j, up 2j + 1
    ref = hf.model.layers[0].mlp.experts.gate_up_proj
    inter = ref.shape[1] // 2
    assert torch.equal(ours[:, 0::2], ref[:, :inter]) and torch.equal(ours[:, 1::2], ref[:, inter:])
    torch.testing.assert_close(our_logits(loaded.model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)


def test_on_cuda_the_attention_runs_the_w4a16_gemm_and_the_experts_stay_dequantized(tmp_path, monkeypatch):
    """The load as on CUDA (the kernels forced on the interpreter): attention linears in the
    W4A16 layout, the quantized experts dequantized and stacked, the same logits."""
    from gpu.quantization import cuda_linear

    monkeypatch.setattr(cuda_linear, "wanted", lambda device: True)
    hf = _write_quantized_moe("ct-w4a16", tmp_path / "w4a16")
    loaded = load_model(tmp_path / "w4a16", dtype="float32", progress=False)
    attn = loaded.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, cuda_linear.QuantLinear) and attn.qkv_proj.kind == "w4"
    assert "kept quantized and run by the Triton GEMMs (6 w4)" in loaded.weights   # qkv and o of 3 layers
    torch.testing.assert_close(our_logits(loaded.model, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)
