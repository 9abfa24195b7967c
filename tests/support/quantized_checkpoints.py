"""Quantized checkpoints written offline from tiny random transformers models, each format by its
documented layout (gpu/quantization/*.py's docstrings): the test quantizes every decoder
linear, writes the format's tensors and quantization_config, and puts the format's own
reference dequantization (numpy unpacking of the bit layout, or compressed-tensors' decompress)
back into the transformers model, which is then the oracle.

make_quantized(fmt, arch, path, **overrides) -> the transformers model holding the reference
dequantized weights (fp32); `path` holds the quantized checkpoint, `path.parent / (path.name +
"-dense")` its dequantized twin in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.support.hf_models import make_hf_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _np_pack_cols(values: np.ndarray, bits: int, order=None) -> np.ndarray:
    """[R, C] ints in [0, 2^b) -> [R, C*b/32] int32: field i of word j is column j*per + order[i]."""
    per = 32 // bits
    R, C = values.shape
    out = np.zeros((R, C // per), dtype=np.uint32)
    for j in range(C // per):
        for i in range(per):
            col = j * per + (order[i] if order else i)
            out[:, j] |= (values[:, col].astype(np.uint32) << np.uint32(i * bits))
    return out.view(np.int32)


def _np_unpack_cols(packed: np.ndarray, bits: int, order=None) -> np.ndarray:
    per = 32 // bits
    words = packed.view(np.uint32)
    R, W = words.shape
    out = np.zeros((R, W * per), dtype=np.int64)
    for j in range(W):
        for i in range(per):
            col = j * per + (order[i] if order else i)
            out[:, col] = (words[:, j] >> np.uint32(i * bits)) & ((1 << bits) - 1)
    return out


def _awq(w: torch.Tensor, group: int, gen: torch.Generator):
    """w [out, in] -> (tensors, reference dequantized [out, in]): asymmetric 4-bit per group."""
    wt = w.t().double().numpy()                                     # [in, out]
    K, N = wt.shape
    g = wt.reshape(K // group, group, N)
    lo, hi = g.min(1), g.max(1)
    scales = ((hi - lo) / 15).astype(np.float16)
    zeros = np.clip(np.round(-lo / scales.astype(np.float64)), 0, 15).astype(np.int64)
    s_rows, z_rows = np.repeat(scales, group, 0).astype(np.float64), np.repeat(zeros, group, 0)
    q = np.clip(np.round(wt / s_rows) + z_rows, 0, 15).astype(np.int64)
    tensors = {"qweight": torch.from_numpy(_np_pack_cols(q, 4, AWQ_ORDER)),
               "qzeros": torch.from_numpy(_np_pack_cols(zeros, 4, AWQ_ORDER)),
               "scales": torch.from_numpy(scales)}
    qq = _np_unpack_cols(tensors["qweight"].numpy(), 4, AWQ_ORDER)
    zz = np.repeat(_np_unpack_cols(tensors["qzeros"].numpy(), 4, AWQ_ORDER), group, 0)
    ref = ((qq - zz) * np.repeat(scales.astype(np.float64), group, 0)).T
    return tensors, torch.from_numpy(ref).float()


def _gptq(w: torch.Tensor, group: int, bits: int, desc_act: bool, fmt: str, gen: torch.Generator):
    """Symmetric GPTQ: (tensors, reference). desc_act: each input row's group drawn from a
    random permutation (the rows keep their order; g_idx names the group)."""
    wt = w.t().double().numpy()                                     # [in, out]
    K, N = wt.shape
    group = K if group <= 0 else group                              # -1: one group a column
    ngroups = K // group
    g_idx = np.arange(K) // group
    if desc_act:
        g_idx = g_idx[torch.randperm(K, generator=gen).numpy()]
    maxq = (1 << bits) - 1
    mid = 1 << (bits - 1)
    scales = np.zeros((ngroups, N), dtype=np.float16)
    for gi in range(ngroups):
        scales[gi] = (np.abs(wt[g_idx == gi]).max(0) / (mid - 0.5)).astype(np.float16)
    s_rows = scales.astype(np.float64)[g_idx]
    q = np.clip(np.round(wt / s_rows) + mid, 0, maxq).astype(np.int64)
    stored_zero = mid - (1 if fmt == "gptq" else 0)
    zeros = np.full((ngroups, N), stored_zero, dtype=np.int64)
    tensors = {"qweight": torch.from_numpy(np.ascontiguousarray(_np_pack_cols(q.T.copy(), bits).T)),
               "qzeros": torch.from_numpy(_np_pack_cols(zeros, bits)),
               "scales": torch.from_numpy(scales),
               "g_idx": torch.from_numpy(g_idx.astype(np.int32))}
    qq = _np_unpack_cols(np.ascontiguousarray(tensors["qweight"].numpy().T), bits).T   # [in, out]
    zz = _np_unpack_cols(tensors["qzeros"].numpy(), bits) + (1 if fmt == "gptq" else 0)
    ref = ((qq - zz[g_idx]) * s_rows).T
    return tensors, torch.from_numpy(ref).float()


def _fp8_block(w: torch.Tensor, block=(128, 128)):
    from gpu.quantization.fp8 import quantize_blocks
    q, scale_inv = quantize_blocks(w, block)
    bo, bi = block
    s = scale_inv.repeat_interleave(bo, 0)[:w.shape[0]].repeat_interleave(bi, 1)[:, :w.shape[1]]
    return {"weight": q, "weight_scale_inv": scale_inv}, q.double().mul(s.double()).float()


def _fp8_tensor(w: torch.Tensor):
    scale = w.abs().max().float() / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    return ({"weight": q, "weight_scale": scale.reshape(()), "input_scale": torch.tensor(0.02)},
            (q.double() * scale.double()).float())


def _ct(w: torch.Tensor, scheme: dict):
    """compressed-tensors: quantized with its own quantize() and packed with its own compressor
    (the writer); the reference is its own decompress()."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(**scheme["weights"])
    wf = w.float()
    out, cols = wf.shape
    if args.strategy == "channel":
        lo, hi = wf.amin(1, keepdim=True), wf.amax(1, keepdim=True)
    elif args.strategy == "group":
        g = wf.reshape(out, cols // args.group_size, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    else:
        lo, hi = wf.min().reshape(1), wf.max().reshape(1)
    qmax = 448.0 if args.type == "float" else float((1 << (args.num_bits - 1)) - 1)
    if args.symmetric:
        scale, zp = torch.maximum(lo.abs(), hi.abs()) / qmax, None
    else:
        levels = (1 << args.num_bits) - 1
        scale = (hi - lo) / levels
        zp = (-(1 << (args.num_bits - 1)) - torch.round(lo / scale)).clamp(-(1 << (args.num_bits - 1)),
                                                                           (1 << (args.num_bits - 1)) - 1)
        zp = zp.to(torch.int8)
    state = {"weight": wf, "weight_scale": scale.float()}
    if zp is not None:
        state["weight_zero_point"] = zp
    full = QuantizationScheme(targets=["Linear"], weights=args)
    fmt = scheme["format"]
    compressor = BaseCompressor.get_value_from_registry(fmt)
    if fmt != "pack-quantized":
        q = quantize(x=wf, scale=state["weight_scale"], zero_point=zp, args=args,
                     dtype=torch.float8_e4m3fn if args.type == "float" else torch.int8)
        tensors = {"weight": q, "weight_scale": state["weight_scale"]}
        if zp is not None:
            tensors["weight_zero_point"] = zp
    else:
        tensors = dict(compressor.compress(state, full))
    if args.type == "int":     # scales in the model's dtype, as llmcompressor writes bf16 models'
        tensors["weight_scale"] = tensors["weight_scale"].bfloat16()
    ref = compressor.decompress({**tensors, "weight_scale": tensors["weight_scale"].float()}, full)["weight"]
    return tensors, ref.float()


def make_quantized(fmt: str, arch: str, path: Path, seed: int = 0, **overrides):
    """fmt: fp8-block, fp8-tensor, ct-fp8-channel, ct-w8a8, ct-w4a16, ct-w4a16-asym, awq,
    gptq4, gptq4-act, gptq8, gptq4-v2."""
    hf = make_hf_model(arch, seed=seed, **{"tie_word_embeddings": False, **overrides})
    gen = torch.Generator().manual_seed(seed + 1)
    qc = QUANT_CONFIGS[fmt]
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            prefix, _, kind = name.rpartition(".")
            if kind != "weight" or prefix.rsplit(".", 1)[-1] not in LINEARS:
                continue
            tensors, ref = _quantize(fmt, qc, p.detach(), gen)
            for suffix, t in tensors.items():
                out[f"{prefix}.{suffix}"] = t.contiguous()
            p.copy_(ref)
            sd.pop(name)
    out.update({k: v for k, v in sd.items() if k not in out})
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    hf.save_pretrained(path.parent / (path.name + "-dense"), safe_serialization=True)
    return hf


def _quantize(fmt, qc, w, gen):
    if fmt == "fp8-block":
        return _fp8_block(w, tuple(qc["weight_block_size"]))
    if fmt == "fp8-tensor":
        return _fp8_tensor(w)
    if fmt.startswith("awq"):
        return _awq(w, qc["group_size"], gen)
    if fmt.startswith("gptq"):
        return _gptq(w, qc["group_size"], qc["bits"], qc["desc_act"], qc.get("checkpoint_format", "gptq"), gen)
    group = qc["config_groups"]["group_0"]
    return _ct(w, {"weights": group["weights"], "format": qc["format"]})


def _ct_config(fmt: str, weights: dict, acts: dict | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head"]}


_W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
QUANT_CONFIGS = {
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [128, 128]},
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    "ct-fp8-channel": _ct_config("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True,
                                                     "strategy": "channel"},
                                 {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
    "ct-w8a8": _ct_config("int-quantized", _W8, {"num_bits": 8, "type": "int", "strategy": "token",
                                                 "dynamic": True, "symmetric": True}),
    "ct-w4a16": _ct_config("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True,
                                              "strategy": "group", "group_size": 32}),
    "ct-w4a16-asym": _ct_config("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": False,
                                                   "strategy": "group", "group_size": 32}),
    "ct-w4a16-g128": _ct_config("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True,
                                                   "strategy": "group", "group_size": 128}),
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "awq-g128": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq4": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
    "gptq4-act": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True},
    "gptq8": {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "sym": True},
    "gptq4-v2": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
                 "checkpoint_format": "gptq_v2"},
}


@pytest.fixture(scope="module")
def fp32_tiles():
    """The packed kernels' fp32 GEMM tiles: where the build has int16 tiles (AVX512_VNNI, and
    AVX2 since issue 60) they round activations to int16 (docs/kernels.md; tests/gpu/test_gguf_packed.py bounds them apart),
    and these tests check the repacked linears compute the dequantized model's products."""
    from gpu.kernels.cpu import quant as cpu_quant

    k = cpu_quant.kernels()
    if k is not None:
        k.set_int16(0)
    yield
    if k is not None:
        k.set_int16(-1)
