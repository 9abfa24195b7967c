"""A mixture's checkpoint tensors in the layout gpu/layers/moe.py runs: every checkpoint's
names mapped to ours (our_name), and experts stored apart stacked (stack_experts).

Checkpoints store experts three ways:
- one tensor per expert and projection (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, GLM-4.5:
  mlp.experts.{e}.{gate,up,down}_proj.weight; Mixtral: block_sparse_moe.experts.{e}.w{1,3,2});
- stacked per projection, [E, out, in] (GGUF's ffn_{gate,up,down}_exps, gpu/formats/gguf.py);
- ours already: mlp.experts.gate_up_proj [E, 2I, D] with gate and up interleaved by row, and
  mlp.experts.down_proj [E, D, I] (a dummy load's weights).
Each layer's gate and up are interleaved into one [E, 2I, D] as soon as both are whole, so at
most one layer's experts are held at a time when the checkpoint lists its tensors by layer.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),                  # Mixtral
    (re.compile(r"\.feed_forward\."), ".mlp."),                      # Llama 4
    (re.compile(r"\.mlp\.gate\.weight$"), ".mlp.router.weight"),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.e_score_correction_bias"),
    (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),  # DeepSeek-V3, GLM-4.5
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
)
_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight")


def our_name(name: str) -> str:
    """A checkpoint's tensor name with a mixture's parts named as ours (gpu/layers/moe.py MoE)."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def stack_experts(named_tensors: Iterable[tuple[str, torch.Tensor]], num_experts: int,
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) with names mapped by our_name, and each layer's experts as ours:
    experts.gate_up_proj [E, 2I, D] (gate row 2j, up row 2j + 1) and experts.down_proj [E, D, I].
    Raises ValueError on an expert index out of range or a layer left incomplete."""
    pending: dict[str, dict[str, list[torch.Tensor | None] | torch.Tensor]] = {}
    for name, tensor in named_tensors:
        name = our_name(name)
        if m := _PER_EXPERT.fullmatch(name):
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            if e >= num_experts:
                raise ValueError(f"{name}: expert {e} of a model with {num_experts} experts")
            parts = pending.setdefault(prefix, {})
            slots = parts.setdefault(proj, [None] * num_experts)
            if not isinstance(slots, list):
                raise ValueError(f"{name}: the layer's {proj} arrived both stacked and per expert")
            slots[e] = tensor
            if all(t is not None for t in slots):
                parts[proj] = torch.stack(slots)
        elif m := _STACKED.fullmatch(name):
            prefix, proj = m.group(1), m.group(2)
            if tensor.dim() != 3 or tensor.shape[0] != num_experts:
                raise ValueError(f"{name}: stacked experts of shape {tuple(tensor.shape)}, "
                                 f"expected [{num_experts}, out, in]")
            pending.setdefault(prefix, {})[proj] = tensor
        else:
            if name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
                tensor = tensor.unsqueeze(0)     # GGUF's ffn_gate_inp_shexp is a vector
            yield name, tensor
            continue
        yield from _whole(prefix, pending)
    for prefix, parts in pending.items():
        have = {p: (sum(t is not None for t in v) if isinstance(v, list) else num_experts) for p, v in parts.items()}
        raise ValueError(f"{prefix}: incomplete experts (of {num_experts}: {have})")


def _whole(prefix: str, pending: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The layer's stacked gate_up (once gate and up are both whole) and down."""
    parts = pending[prefix]
    down = parts.get("down_proj")
    if isinstance(down, torch.Tensor):
        del parts["down_proj"]
        yield prefix + ".down_proj", down
    gate, up = parts.get("gate_proj"), parts.get("up_proj")
    if isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor):
        if gate.shape != up.shape:
            raise ValueError(f"{prefix}: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        del parts["gate_proj"], parts["up_proj"]
        E, I, D = gate.shape  # noqa: E741
        yield prefix + ".gate_up_proj", torch.stack([gate, up], dim=2).reshape(E, 2 * I, D)
    if not parts:
        del pending[prefix]
