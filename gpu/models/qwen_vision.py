"""Qwen2.5-VL's vision side (issue 34): the vision transformer and the patch merger that
map one picture's flattened patches (stages/media/images.py `qwen_patches`, made in render)
into the decoder's embedding space, one feature per merge_size x merge_size block of
patches. The decoder is gpu/models/causal_lm.py's CausalLM with M-RoPE; `mrope_positions` gives a
prompt's (t, h, w) positions.

The tower: the patch embedding (transformers' Conv3d, whose kernel is its stride: a
linear over each patch's C*T*P*P values), a 2D rotary embedding over each patch's (row,
column), blocks of pre-RMSNorm attention and a SwiGLU MLP, the blocks in
`fullatt_block_indexes` attending over the whole picture and the others within windows
of window_size pixels. The patches are put in window order once (the window index
permutation, by merge blocks) before the blocks and back in raster order after the merger.
Attention is bidirectional, torch's SDPA (a fused kernel on CUDA), no KV cache: a
windowed block's windows (and a video's frames) are gathered into one padded batch
[windows, heads, longest, head_dim] with a key mask, so a window costs its own length
squared, not the picture's."""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpu.models.llava_vision import _act, load_vision_weights
from gpu.config.vision import qwen_vision_config


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype, device, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dtype, device):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, dtype=dtype, device=device)
        self.proj = nn.Linear(dim, dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """x [S, D], cos/sin [S, hd] -> [S, D]. segments: None (every row sees every row),
        or (index [W, L], valid [W, L]): the rows of each of W segments, padded with S."""
        s, d = x.shape
        q, k, v = self.qkv(x).view(s, 3, self.heads, d // self.heads).unbind(1)   # [S, H, hd]
        c, sn = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * c + _rotate_half(q.float()) * sn).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * sn).to(x.dtype)
        if segments is None:
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                 v.transpose(0, 1))              # [H, S, hd]
            return self.proj(out.transpose(0, 1).reshape(s, d))
        index, valid = segments

        def batch(t: torch.Tensor) -> torch.Tensor:     # [S, H, hd] -> [W, H, L, hd]
            return torch.cat([t, t.new_zeros(1, *t.shape[1:])])[index].transpose(1, 2)

        out = F.scaled_dot_product_attention(batch(q), batch(k), batch(v),
                                             attn_mask=valid[:, None, None, :])  # [W, H, L, hd]
        return self.proj(out.transpose(1, 2)[valid].reshape(s, d))


class _Block(nn.Module):
    def __init__(self, v: dict, dtype, device):
        super().__init__()
        dim, inter = v["hidden_size"], v["intermediate_size"]
        self.norm1 = _RMSNorm(dim, dtype, device)
        self.norm2 = _RMSNorm(dim, dtype, device)
        self.attn = _Attention(dim, v["num_heads"], dtype, device)
        self.mlp = nn.Module()
        for name, (i, o) in {"gate_proj": (dim, inter), "up_proj": (dim, inter),
                             "down_proj": (inter, dim)}.items():
            setattr(self.mlp, name, nn.Linear(i, o, dtype=dtype, device=device))
        self.act = _act(v["hidden_act"])

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        h = self.norm2(x)
        m = self.mlp
        return x + m.down_proj(self.act(m.gate_proj(h)) * m.up_proj(h))


def _segments(lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Consecutive runs of rows of these lengths as (index [W, L], valid [W, L]), each run's
    rows padded to the longest with the row count (a zero row the caller appends); None
    for one run (plain attention over every row)."""
    if len(lengths) == 1:
        return None
    longest, total = max(lengths), sum(lengths)
    starts = np.cumsum([0, *lengths[:-1]])
    index = starts[:, None] + np.arange(longest)[None, :]
    valid = np.arange(longest)[None, :] < np.asarray(lengths)[:, None]
    index = np.where(valid, index, total)
    return torch.from_numpy(index).to(device), torch.from_numpy(valid).to(device)


def window_index(grid: tuple[int, int, int], merge: int, window: int
                 ) -> tuple[np.ndarray, list[int]]:
    """The merge blocks of one picture (grid: its patches (t, h, w)) in window order,
    windows of `window` x `window` merge blocks taken row by row, each window's blocks row
    by row; and the windows' lengths in blocks (the last row's and column's windows cut
    short, empty ones left out)."""
    t, h, w = grid
    lh, lw = h // merge, w // merge
    order, lengths = [], []
    for f in range(t):
        for r0 in range(0, lh, window):
            for c0 in range(0, lw, window):
                rows = np.arange(r0, min(r0 + window, lh))
                cols = np.arange(c0, min(c0 + window, lw))
                order.append((f * lh * lw + rows[:, None] * lw + cols[None, :]).reshape(-1))
                lengths.append(len(rows) * len(cols))
    return np.concatenate(order), lengths


class QwenVision(nn.Module):
    """The tower and the merger: one picture's patches [P, C*T*ps*ps] and its grid
    (t, h, w) -> [P / merge**2, text hidden size]."""

    variable_size = True    # pictures of any size, one at a time (the runner's _encode)

    def __init__(self, config: dict, text_hidden: int, dtype=torch.float32, device="cpu"):
        super().__init__()
        v = qwen_vision_config(config)
        dim, heads = v["hidden_size"], v["num_heads"]
        self.merge = v["spatial_merge_size"]
        self.window = v["window_size"] // self.merge // v["patch_size"]
        self.full = set(v["fullatt_block_indexes"])
        self.patch_dim = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
        if v["out_hidden_size"] != text_hidden:
            raise ValueError(f"the vision tower's out_hidden_size {v['out_hidden_size']} is not "
                             f"the decoder's hidden_size {text_hidden}")
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = nn.Parameter(torch.empty(
            dim, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"],
            dtype=dtype, device=device))
        head_dim = dim // heads
        spatial = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / (v["rope_theta"] ** (
            torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial)),
            persistent=False)
        self.blocks = nn.ModuleList(_Block(v, dtype, device) for _ in range(v["depth"]))
        hidden = dim * self.merge ** 2
        self.merger = nn.Module()
        self.merger.ln_q = _RMSNorm(dim, dtype, device)
        self.merger.mlp = nn.ModuleList([
            nn.Linear(hidden, hidden, dtype=dtype, device=device), nn.GELU(),
            nn.Linear(hidden, v["out_hidden_size"], dtype=dtype, device=device)])

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def _rope(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, head_dim] of each patch in the pixels' (merge-block) order."""
        t, h, w = grid
        m = self.merge
        rows = torch.arange(h, device=self.inv_freq.device)[:, None].expand(h, w)
        cols = torch.arange(w, device=self.inv_freq.device)[None, :].expand(h, w)
        blocks = lambda x: x.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1)  # noqa: E731
        pos = torch.stack([blocks(rows), blocks(cols)], dim=-1).repeat(t, 1)        # [P, 2]
        freqs = (pos[..., None].float() * self.inv_freq).reshape(pos.shape[0], -1)   # [P, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid
        n = t * h * w
        if pixels.shape != (n, self.patch_dim):
            raise ValueError(f"a picture of grid {grid} has {n} patches of {self.patch_dim} "
                             f"values; got {tuple(pixels.shape)}")
        unit = self.merge ** 2
        weight = self.patch_embed.proj.weight
        x = F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1))    # [P, D]
        order, lengths = window_index(grid, self.merge, self.window)
        order_t = torch.from_numpy(order).to(x.device)
        x = x.view(n // unit, unit, -1)[order_t].reshape(n, -1)
        cos, sin = (c.view(n // unit, unit, -1)[order_t].reshape(n, -1) for c in self._rope(grid))
        windowed = _segments([l * unit for l in lengths], x.device)
        # a frame's patches are a whole number of windows: window order keeps frames apart
        full = _segments([h * w] * t, x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in self.full else windowed)
        g = self.merger
        x = g.mlp[2](g.mlp[1](g.mlp[0](g.ln_q(x).view(n // unit, -1))))    # [P/unit, out]
        return x[torch.from_numpy(np.argsort(order)).to(x.device)]

    @staticmethod
    def split_checkpoint(named, vision: list):
        return split_checkpoint(named, vision)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Our names (patch_embed.*, blocks.*, merger.*); raises on unknown, misshapen or
        missing weights."""
        load_vision_weights(self, named)


def split_checkpoint(named: Iterable[tuple[str, torch.Tensor]], vision: list):
    """A Qwen2.5-VL checkpoint's tensors, by transformers 4's names (model.layers.*,
    visual.*) or 5's (model.language_model.*, model.visual.*): the decoder's yielded as
    CausalLM names them, the vision side's appended to `vision` without the visual. prefix."""
    for name, t in named:
        if name.startswith("model.visual."):
            name = name[len("model."):]
        if name.startswith("visual."):
            vision.append((name[len("visual."):], t))
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        yield name, t


def mrope_positions(length: int, images, merge: int) -> tuple[np.ndarray, int]:
    """A prompt's M-RoPE positions [3, length] (t, h, w) and its rope delta, as
    transformers' get_rope_index makes them: text tokens count on from the last position
    + 1, a picture's tokens take (start, start + row, start + column) by merge block, and
    the text after it starts at start + max(rows, columns). Past the prompt every
    position is p + delta, the same in all three."""
    pos = np.zeros((3, length), dtype=np.int64)
    nxt, prev = 0, 0
    for im in sorted(images, key=lambda im: im.offset):
        n_text = im.offset - prev
        pos[:, prev:im.offset] = nxt + np.arange(n_text)
        nxt += n_text
        t, h, w = im.grid
        lh, lw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        pos[:, im.offset:im.offset + im.length] = nxt + np.stack([tt, hh, ww]).reshape(3, -1)
        nxt += max(lh, lw)
        prev = im.offset + im.length
    pos[:, prev:] = nxt + np.arange(length - prev)
    delta = int(pos.max()) + 1 - length if length else 0
    return pos, delta
