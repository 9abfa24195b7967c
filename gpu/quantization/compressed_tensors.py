"""compressed-tensors checkpoints (llmcompressor's output; RedHat's W8A8, W4A16 and FP8 builds):

  {"quant_method": "compressed-tensors", "format": "pack-quantized",
   "config_groups": {"group_0": {"targets": ["Linear"], "format": optional, per group,
       "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                   "symmetric": true, "actorder": null, "block_structure": null},
       "input_activations": null | {"num_bits": 8, "type": "int", "strategy": "token",
                                    "dynamic": true}}},
   "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": null | {...}}

The formats (compressed-tensors' compressors, read in its source):
  float-quantized / int-quantized / naive-quantized: NAME.weight holds the quantized values
    (float8_e4m3fn, or int8), with NAME.weight_scale and, asymmetric, NAME.weight_zero_point;
  pack-quantized: NAME.weight_packed int32 [out, ceil(in * b / 32)], element i of a row at
    bits i*b .. i*b+b-1 of the row's little-endian bit string, stored as q + 2^(b-1);
    NAME.weight_shape [2] the dense shape; NAME.weight_scale; asymmetric: NAME.weight_zero_point
    packed the same way along the rows ([ceil(out * b / 32), groups]); actorder "group":
    NAME.weight_g_idx [in], the group of each input column.
Scales: per tensor ([1]), per channel ([out, 1]), per group ([out, in / g]) or per block
([ceil(out / bo), ceil(in / bi)]). w = (q - zero_point) * scale.

Input activation scales (NAME.input_scale: `dynamic: false`, compressed-tensors' default,
static W8A8 or FP8) are required; on CUDA the INT8 and FP8 GEMMs quantize activations by them
(gpu/quantization/cuda_linear.py); dequantized (on a CPU) they are dropped and activations stay in
the serving dtype.
"""

from __future__ import annotations

import re

import torch

from gpu.quantization import fp8
from gpu.quantization.base import LinearFormat

FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """[R, W] int32 -> [R, count] int64: element i from bits i*bits .. of each row's
    little-endian bit string (compressed-tensors' pack_to_int32), offset 2^(bits-1) removed."""
    if not 1 <= bits <= 8:
        raise ValueError(f"pack-quantized weights of {bits} bits")
    words = packed.to(torch.int64) & 0xFFFFFFFF                     # [R, W] as unsigned
    start = torch.arange(count, device=packed.device) * bits
    word, offset = start // 32, start % 32
    lo = words[:, word] >> offset
    nxt = words[:, (word + 1).clamp(max=words.shape[1] - 1)]
    value = (lo | (nxt << (32 - offset))) & ((1 << bits) - 1)         # the bits past the word's end
    return value - (1 << (bits - 1))


def _strategy_scale(scale: torch.Tensor, args: dict, out: int, cols: int,
                    g_idx: torch.Tensor | None) -> torch.Tensor:
    """The scale (or zero point) per element of a [out, cols] weight, broadcastable."""
    strategy = args.get("strategy", "tensor")
    if strategy == "block":
        bo, bi = args.get("block_structure") or (128, 128)
        return fp8.expand_scale(scale, out, cols, (int(bo), int(bi)))
    if strategy in ("group", "tensor_group") and g_idx is not None:
        return scale.float()[:, g_idx.long()]
    return fp8.expand_scale(scale, out, cols)


class CompressedTensors(LinearFormat):
    name = "compressed-tensors"
    markers = ("weight_scale", "weight_packed")
    suffixes = ("weight", "weight_scale", "weight_zero_point", "weight_packed", "weight_shape",
                "weight_g_idx", "input_scale", "input_zero_point")

    def __init__(self, config: dict):
        super().__init__(config)
        self.format = config.get("format", "dense")
        self.groups = []
        for gname, group in (config.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            fmt = group.get("format") or self.format
            if fmt not in FORMATS:
                raise ValueError(f"compressed-tensors: format {fmt!r} (group {gname}) is not served; "
                                 f"served: {', '.join(FORMATS)}")
            if w.get("type", "int") == "float" and w.get("num_bits") != 8:
                raise ValueError(f"compressed-tensors: {w.get('num_bits')}-bit float weights (group {gname})")
            if w.get("strategy") in ("tensor_group",) or w.get("actorder") == "weight":
                raise ValueError(f"compressed-tensors: weights {w.get('strategy')}/{w.get('actorder')} "
                                 f"(group {gname}) are not served")
            self.groups.append((gname, tuple(group.get("targets") or ("Linear",)), fmt, w,
                                group.get("input_activations")))
        if not self.groups:
            raise ValueError("compressed-tensors: the quantization_config has no config_groups")
        self.ignore = tuple(config.get("ignore") or ())
        self.integer_grid = all(w.get("type", "int") == "int" for _, _, _, w, _ in self.groups)

    def group(self, prefix: str):
        short = prefix.rsplit(".", 1)[-1]
        named = [g for g in self.groups if any(t != "Linear" and _matches(t, prefix, short) for t in g[1])]
        return (named or [g for g in self.groups if "Linear" in g[1]] or [None])[0]

    def ignored(self, prefix: str) -> bool:
        return any(_matches(t, prefix, prefix.rsplit(".", 1)[-1]) for t in self.ignore)

    def required(self, prefix: str) -> tuple[str, ...]:
        g = self.group(prefix)
        if g is None:
            raise ValueError(f"compressed-tensors: {prefix} has quantized tensors but no config group targets it")
        _, _, fmt, w, _ = g
        need = ("weight_packed", "weight_shape") if fmt == "pack-quantized" else ("weight",)
        need += ("weight_scale",)
        if not w.get("symmetric", True):
            need += ("weight_zero_point",)
        if w.get("actorder") == "group":
            need += ("weight_g_idx",)
        if self.static_activations(prefix):
            need += ("input_scale",)
        return need

    def static_activations(self, prefix: str) -> bool:
        acts = self.group(prefix)[4]
        return bool(acts) and not acts.get("dynamic", False)   # compressed-tensors' default: static

    def dequantize(self, prefix, parts, dtype):
        w = self.group(prefix)[3]
        if w.get("type", "int") == "float":
            return fp8.dequantize(parts["weight"], parts["weight_scale"], dtype, _block(w))
        return super().dequantize(prefix, parts, dtype)

    def kernel_kind(self, prefix):
        _, _, _, w, acts = self.group(prefix)
        bits = int(w.get("num_bits", 8))
        if acts and acts.get("type", "int") == "int" and int(acts.get("num_bits", 8)) == 8 and bits == 8 \
                and acts.get("symmetric", True):
            return "int8"
        return f"w{bits}" if bits in (4, 8) and not acts else None

    def kernel_parts(self, prefix, parts):
        w = self.group(prefix)[3]
        if w.get("type", "int") == "float":
            q = parts["weight"]
            return ("fp8", q, _strategy_scale(parts["weight_scale"], w, *q.shape, parts.get("weight_g_idx")),
                    self.input_scale(prefix, parts))
        return super().kernel_parts(prefix, parts)

    def integers(self, prefix, parts):
        _, _, fmt, w, _ = self.group(prefix)
        bits = int(w.get("num_bits", 8))
        if fmt == "pack-quantized":
            out, cols = (int(x) for x in parts["weight_shape"].tolist())
            q = unpack_int32(parts["weight_packed"], bits, cols)
        else:
            q = parts["weight"].to(torch.int64)
            out, cols = q.shape
        g_idx = parts.get("weight_g_idx")
        if "weight_zero_point" in parts:
            zp = parts["weight_zero_point"]
            if fmt == "pack-quantized" and zp.dtype == torch.int32 and w.get("strategy") in ("group", "channel"):
                groups = parts["weight_scale"].shape[-1]
                zp = unpack_int32(zp.t().contiguous(), bits, out).t()     # packed along the rows
                zp = zp[:, :groups]
            q = q - _strategy_scale(zp.float(), w, out, cols, g_idx).long()
        return q, _strategy_scale(parts["weight_scale"], w, out, cols, g_idx)

    def scheme(self) -> str:
        kinds = []
        for _, _, fmt, w, acts in self.groups:
            a = "A16" if not acts else f"A{acts.get('num_bits', 8)}"
            kind = "FP" if w.get("type") == "float" else "INT"
            g = f" group {w.get('group_size')}" if w.get("strategy") == "group" else f" per-{w.get('strategy')}"
            sym = "" if w.get("symmetric", True) else " asymmetric"
            kinds.append(f"{fmt} W{w.get('num_bits')}{a} ({kind}{g}{sym})")
        return "compressed-tensors " + ", ".join(kinds)



def _block(w: dict):
    if w.get("strategy") != "block":
        return None
    bo, bi = w.get("block_structure") or (128, 128)
    return int(bo), int(bi)


def _matches(target: str, prefix: str, short: str) -> bool:
    """compressed-tensors' target matching: "re:REGEX" against the module's full name, else the
    name itself or its last part (class names other than Linear never match a linear here)."""
    if target.startswith("re:"):
        return re.match(target[3:], prefix) is not None or re.match(target[3:], prefix.removeprefix("model.")) is not None
    return target in (prefix, prefix.removeprefix("model."), short)
