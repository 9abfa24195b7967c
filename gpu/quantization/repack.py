"""Integer-grid weights repacked into GGUF blocks for the packed CPU kernels
(gpu/kernels/cpu/quant.c), where the repacking is exact.

A W8A8 or 4-bit linear dequantizes as w = n * s with n an integer (q minus its zero point)
and s its group's or channel's scale. GGUF's 32-element blocks hold one fp16 scale d each:
  Q4_0: w = d * (nibble - 8), nibble in 0..15   (n in [-8, 7]: symmetric 4-bit);
  Q8_0: w = d * i8, i8 in [-128, 127]           (n in [-128, 127]: INT8, and asymmetric
                                                 4-bit, where n = q - z lies in [-15, 15]).
The blocks reproduce w bit for bit when (1) every 32 consecutive input columns share one scale
(groups of a multiple of 32 along the input, or a scale per row; not act-order's permuted
groups) and (2) that scale is an fp16 value (AWQ and GPTQ store fp16 scales; bf16 scales
inside fp16's normal range are too; fp32 scales rarely are): then d * n is n * s exactly in
fp32 (11 + 8 significant bits), the very value the dequantized weight holds. A linear that
fails either test stays dequantized. Q4_1 (w = d * nibble + m) would fit asymmetric 4-bit in
5 bits a weight, but m = -s * z needs up to 15 significant bits, which fp16 rounds: not exact.

The kernels then multiply fp32 activations (no activation quantization, unlike W8A8 on a
GPU): the packed linear computes the dequantized model's product, in another summation order.
"""

from __future__ import annotations

import torch

Q4_0, Q8_0 = 2, 8       # ggml type ids (gpu/kernels/cpu/quant.py FORMATS)
BLOCK = 32


def block_form(n: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """n [out, in] integers, scale [out, in] (or broadcastable) fp32 per element -> (n as int8,
    the fp16 scale of each 32-column block [out, in/32]) when the blocks are exact, else None."""
    out, cols = n.shape
    if cols % BLOCK or n.min() < -128 or n.max() > 127:
        return None
    s = scale.float().expand(out, cols).reshape(out, cols // BLOCK, BLOCK)
    d = s[..., 0]
    if not torch.equal(s, d.unsqueeze(-1).expand_as(s)):       # one scale a block
        return None
    d16 = d.to(torch.float16)
    if not torch.equal(d16.float(), d) or not torch.isfinite(d16).all():   # an fp16 value
        return None
    return n.to(torch.int8), d16


def to_blocks(n: torch.Tensor, d: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(n int8 [rows, in], d fp16 [rows, in/32]) -> (ggml type, uint8 [rows, row_bytes]):
    Q4_0 when every n is in [-8, 7], else Q8_0."""
    rows, cols = n.shape
    nb = cols // BLOCK
    d_bytes = d.contiguous().view(torch.uint8).reshape(rows, nb, 2)   # little-endian fp16
    q = n.reshape(rows, nb, BLOCK)
    if int(n.min()) >= -8 and int(n.max()) <= 7:
        nib = (q.to(torch.int16) + 8).to(torch.uint8)
        packed = nib[..., :16] | (nib[..., 16:] << 4)          # byte j: element j low, j + 16 high
        return Q4_0, torch.cat([d_bytes, packed], -1).reshape(rows, nb * 18).contiguous()
    return Q8_0, torch.cat([d_bytes, q.view(torch.uint8)], -1).reshape(rows, nb * 34).contiguous()


# (owner attribute, our merged module, its HF parts in row order)
_MERGED = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
           ("self_attn", "o_proj", ("o_proj",)),
           ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
           ("mlp", "down_proj", ("down_proj",)))


def pack_model(lm, blocks: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int, dict]:
    """Replace each of lm's decoder linears whose every part is in `blocks` (HF prefix ->
    block_form) by a PackedLinear; (linears packed, linears kept dense, count per format)."""
    from gpu.kernels.cpu import quant as cpu_quant
    from gpu.models.causal_lm import MLP

    packed = dense = 0
    formats: dict[str, int] = {}
    for i, layer in enumerate(lm.layers):
        for owner_name, module, parts in _MERGED:
            owner = getattr(layer, owner_name)
            if owner_name == "mlp" and not isinstance(owner, MLP):
                continue
            names = [f"model.layers.{i}.{owner_name}.{p}" for p in parts]
            if not all(n in blocks for n in names):
                dense += 1
                continue
            linear = getattr(owner, module)
            segments = [to_blocks(*blocks.pop(n)) for n in names]
            bias = None if linear.bias is None else linear.bias.detach().float().clone()
            setattr(owner, module, cpu_quant.PackedLinear(linear.in_features, segments, bias))
            packed += 1
            for fmt, _ in segments:
                formats[cpu_quant.FORMATS[fmt]] = formats.get(cpu_quant.FORMATS[fmt], 0) + 1
    return packed, dense, formats
