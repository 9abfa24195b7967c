"""MXFP4 (OCP Microscaling, FP4 e2m1 elements with a shared e8m0 scale per 32) -> bf16.

gpt-oss checkpoints store each expert matrix W [E, rows, cols] as two tensors:
  NAME_blocks [E, rows, cols/32, 16] uint8: 32 FP4 codes per block, two per byte, the
              element at even column in the low nibble, the next one in the high nibble;
  NAME_scales [E, rows, cols/32] uint8: the block's e8m0 exponent s, scale 2^(s - 127).
An FP4 e2m1 code is sign(1) exponent(2) mantissa(1); its values, by code 0..15, are
FP4_VALUES. Element value = FP4_VALUES[code] * 2^(s - 127).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] in dtype.

    Exact in bf16 for every scale bf16 can represent (FP4 values have at most two significant
    bits); an exponent out of the dtype's range saturates as torch.ldexp does."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         "(expected blocks [..., G, 16] and scales [..., G])")
    *lead, G, _ = blocks.shape
    flat_blocks, flat_scales = blocks.reshape(-1, G, 16), scales.reshape(-1, G)
    out = torch.empty(flat_blocks.shape[0], G * 32, dtype=dtype, device=blocks.device)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    step = max(1, _CHUNK_ELEMENTS // (G * 32))  # bounds the int32/fp32 temporaries
    for r in range(0, out.shape[0], step):
        b, s = flat_blocks[r:r + step], flat_scales[r:r + step]
        codes = torch.stack([b & 0x0F, b >> 4], dim=-1).to(torch.int32)       # [R, G, 16, 2]
        values = lut[codes].flatten(-2)                                        # [R, G, 32]
        exponent = (s.to(torch.int32) - 127).unsqueeze(-1)                     # 2^(s - 127)
        out[r:r + step] = torch.ldexp(values, exponent.float()).flatten(-2).to(dtype)
    return out.reshape(*lead, G * 32)


_CHUNK_ELEMENTS = 1 << 24


def dequantize_packed(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed experts as kept in memory, blocks [E, N, K/2] and scales [E, N, K/32] uint8
    (the checkpoint's blocks with [K/32, 16] flattened) -> [E, N, K] in dtype."""
    E, N, half_k = blocks.shape
    return dequantize(blocks.reshape(E, N, half_k // 16, 16), scales, dtype)


def dequantize_pairs(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, replacing each NAME_blocks / NAME_scales pair (in any order, any
    distance apart) by NAME, dequantised to dtype on device (the GPU when loading onto one:
    much faster than the host). An unpaired half is an error at the end."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}
    for name, tensor in named:
        suffix = next((x for x in (BLOCKS_SUFFIX, SCALES_SUFFIX) if name.endswith(x)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        if base not in pending:
            pending[base] = (suffix, tensor)
            continue
        other_suffix, other = pending.pop(base)
        if other_suffix == suffix:
            raise ValueError(f"checkpoint has {name!r} twice")
        blocks, scales = (tensor, other) if suffix == BLOCKS_SUFFIX else (other, tensor)
        yield base, dequantize(blocks.to(device), scales.to(device), dtype)
    if pending:
        base, (suffix, _) = next(iter(pending.items()))
        missing = SCALES_SUFFIX if suffix == BLOCKS_SUFFIX else BLOCKS_SUFFIX
        raise ValueError(f"checkpoint has {base + suffix!r} but not {base + missing!r}")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., cols] float (cols a multiple of 32) -> (blocks, scales), rounding each element to
    the nearest FP4 value after dividing by its block's power-of-two scale (chosen so the
    block's largest magnitude is at most 6). For tests and tools; not used when serving."""
    *lead, cols = w.shape
    if cols % 32:
        raise ValueError(f"MXFP4 needs a multiple of 32 columns, got {cols}")
    blocks = w.float().reshape(*lead, cols // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127).to(torch.int32)  # amax / 2^e <= 6
    scaled = blocks / torch.exp2(exponent.float()).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES[:8])
    code = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1)                       # nearest magnitude
    code = code | ((scaled < 0).long() << 3)
    pairs = code.reshape(*lead, cols // 32, 16, 2).to(torch.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4), (exponent + 127).to(torch.uint8)

