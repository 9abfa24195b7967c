"""FP8 (e4m3) weights with per-tensor, per-channel, per-group or block scales: vLLM's `fp8`
method, the quantization_config DeepSeek-V3 and Qwen3-*-FP8 ship:

  {"quant_method": "fp8", "activation_scheme": "dynamic" | "static", "fmt": "e4m3",
   "weight_block_size": [128, 128], "ignored_layers" | "modules_to_not_convert": [...]}

A quantized linear is NAME.weight [out, in] float8_e4m3fn with
  - with weight_block_size [bo, bi]: NAME.weight_scale_inv [ceil(out/bo), ceil(in/bi)] fp32,
    w[r, c] = weight[r, c] * weight_scale_inv[r // bo, c // bi] (the "_inv" is historical: it
    multiplies);
  - without: NAME.weight_scale, one fp32 per tensor ([] or [1]), w = weight * weight_scale;
and, for static activations, NAME.input_scale (the activation's per-tensor scale).

Dequantized once at load to the serving dtype: an e4m3 value times an fp32 scale is exact in
fp32 (a 4-bit significand times a 24-bit one rounds once), and within bf16's rounding in bf16.
Activations then stay in the serving dtype (no fp8 rounding of them, static or dynamic).
"""

from __future__ import annotations

import torch

from gpu.quantization.base import LinearFormat

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def expand_scale(scale: torch.Tensor, out: int, cols: int, block: tuple[int, int] | None = None) -> torch.Tensor:
    """A weight's scale -> a [out, cols] (or broadcastable) fp32 multiplier. scale: one value
    ([] or [1]); per output row ([out] or [out, 1]); block [ceil(out/bo), ceil(cols/bi)] with
    block = (bo, bi); or per group along the input, [out, cols / g]."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1)
    if block is not None and s.dim() == 2 and tuple(s.shape) == (-(-out // block[0]), -(-cols // block[1])):
        bo, bi = block      # before the per-channel reading: [ceil(out/bo), 1] blocks when cols <= bi
        return s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :cols]
    if s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1):
        if s.shape[0] != out:
            raise ValueError(f"a per-channel scale of {tuple(scale.shape)} for {out} rows")
        return s.reshape(out, 1)
    if s.dim() != 2:
        raise ValueError(f"a scale of shape {tuple(scale.shape)}")
    if block is not None:
        bo, bi = block
        if tuple(s.shape) != (-(-out // bo), -(-cols // bi)):
            raise ValueError(f"block scales {tuple(scale.shape)} do not cover [{out}, {cols}] in "
                             f"{bo}x{bi} blocks (expected {(-(-out // bo), -(-cols // bi))})")
        return s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :cols]
    if s.shape[0] == out and cols % s.shape[1] == 0:     # groups along the input
        return s.repeat_interleave(cols // s.shape[1], 1)
    raise ValueError(f"a scale of shape {tuple(scale.shape)} for a [{out}, {cols}] weight")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """FP8 weight [out, in] and its scale (expand_scale's shapes) -> [out, in] in dtype."""
    if weight.dtype not in FP8_DTYPES:
        raise ValueError(f"an FP8 weight must be float8_e4m3fn or float8_e5m2, got {weight.dtype}")
    out, cols = weight.shape
    return (weight.float() * expand_scale(scale, out, cols, block)).to(dtype)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (e4m3 weight, weight_scale_inv [ceil(out/bo), ceil(in/bi)] fp32), each
    block scaled so its largest magnitude is e4m3's 448 (DeepSeek's recipe). For tests and
    tools; not used when serving."""
    bo, bi = block
    out, cols = w.shape
    padded = torch.zeros(-(-out // bo) * bo, -(-cols // bi) * bi)
    padded[:out, :cols] = w.float()
    blocks = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:out, :cols]
    return q.to(torch.float8_e4m3fn), scale


class FP8(LinearFormat):
    """vLLM's `fp8` checkpoints (weight_scale_inv blocks or a per-tensor weight_scale)."""

    name = "fp8"
    markers = ("weight_scale_inv", "weight_scale")
    suffixes = ("weight", "weight_scale_inv", "weight_scale", "input_scale")

    def __init__(self, config: dict):
        super().__init__(config)
        block = config.get("weight_block_size")
        self.block = (int(block[0]), int(block[1])) if block else None
        if block is not None and len(block) != 2:
            raise ValueError(f"fp8: weight_block_size {block} is not [rows, columns]")
        if config.get("fmt", "e4m3") not in ("e4m3", "e5m2"):
            raise ValueError(f"fp8: fmt {config.get('fmt')!r} is neither e4m3 nor e5m2")
        self.activations = config.get("activation_scheme", "dynamic")
        self.skip = tuple(config.get("ignored_layers") or config.get("modules_to_not_convert") or ())

    def required(self, prefix: str) -> tuple[str, ...]:
        return ("weight", "weight_scale_inv" if self.block else "weight_scale") + (
            ("input_scale",) if self.static_activations(prefix) else ())

    def static_activations(self, prefix: str) -> bool:
        return self.activations == "static"

    def ignored(self, prefix: str) -> bool:
        short = prefix.removeprefix("model.")
        return any(prefix == s or short == s.removeprefix("model.") or prefix.endswith("." + s)
                   for s in self.skip)

    def dequantize(self, prefix, parts, dtype):
        scale = parts["weight_scale_inv"] if self.block else parts["weight_scale"]
        return dequantize(parts["weight"], scale, dtype, self.block)

    def kernel_parts(self, prefix, parts):
        scale = parts["weight_scale_inv"] if self.block else parts["weight_scale"]
        w = parts["weight"]
        return "fp8", w, expand_scale(scale, *w.shape, self.block), self.input_scale(prefix, parts)

    def scheme(self) -> str:
        scales = f"{self.block[0]}x{self.block[1]} block-scaled" if self.block else "per-tensor-scaled"
        return f"FP8 e4m3 ({scales}, {self.activations} activations)"

