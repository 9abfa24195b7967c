"""LoRA adapters in the runner (issue 33): PEFT's folders read and checked, and the batched
LoRA term added after each patched linear.

A PEFT adapter folder holds adapter_config.json (`r`, `lora_alpha`, `target_modules`,
`use_rslora`...) and adapter_model.safetensors (`...layers.{i}.self_attn.q_proj.lora_A.weight`
[r, in] and `lora_B.weight` [out, r]). The model merges q/k/v into qkv_proj and gate/up into
gate_up_proj (gpu/models/causal_lm.py): an adapter's A matrices of one merged linear are stacked
([sum r, in]) and its B matrices laid block-wise into [out, sum r] at their slices' rows, so
one merged linear's LoRA term is two matmuls whatever it targets.

The term is added after the base linear, as a forward hook: y = base(x) + scale * (x A^T) B^T
(the scale folded into B), so it holds whatever the base linear is (oneDNN packed, a GGUF
kernel, CUDA). One step mixes base rows and several adapters: `LoRAManager.prepare` sorts the
step's LoRA rows by adapter once (`perm`); each hooked linear gathers those rows once, runs
two matmuls per adapter over its contiguous run, and adds the result back with one
`index_add_`. Rows without an adapter cost nothing. On the CPU the same groups go instead to
one call of gpu/kernels/cpu/lora.c per hooked linear (shrink and expand of every group, each
adapter's A and B read once; `set_step` packs the groups' weight pointers once a step).

On CUDA the term is instead the Triton shrink/expand pair of gpu/kernels/triton/lora.py (the
Punica / S-LoRA design): `_Slots` holds, per hooked linear, every adapter of the step in one
of `max_loras` slots of a stacked A [S, R, in] and B [S, out, R] (R: --max-lora-rank times the
linear's fused parts; each slot's own rank in `ranks`, the part the kernels read), `set_step` builds the step's row -> slot index once (-1:
no adapter), and each hook makes one shrink and one expand launch whatever the adapters.
TAILRACE_LORA_BACKEND=torch|triton overrides the choice (triton on the CPU runs under
TRITON_INTERPRET=1, for tests).

Weights are loaded on a sequence's first step (the runner thread), kept in an LRU of
`--max-cpu-loras` adapters; an adapter in use by a running sequence is never evicted, and one
unloaded at run time (`forget`) is dropped once its last sequence is released.
"""
from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

import attrs
import torch

from gpu.config.model import ModelConfig
from gpu.interface import LoRARef

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# HF module name -> (our linear within a decoder layer, its slice of the merged output or None)
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", None),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", None)}
_MLP = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


BACKENDS = ("torch", "triton", "cpu")


def lora_backend(device: torch.device) -> str:
    """The batched LoRA term's implementation: TAILRACE_LORA_BACKEND if set, else triton on
    CUDA, the grouped C kernel (gpu/kernels/cpu/lora.c) on the CPU where it builds, and torch
    (grouped matmuls) otherwise. cpu without a built kernel falls back to torch."""
    value = os.environ.get("TAILRACE_LORA_BACKEND", "").strip().lower()
    if value and value not in BACKENDS:
        raise ValueError(f"TAILRACE_LORA_BACKEND={value!r}: expected one of {', '.join(BACKENDS)}")
    kind = torch.device(device).type
    if not value:
        value = "triton" if kind == "cuda" else "cpu"
    if value == "cpu":
        from gpu.kernels.cpu import lora as cpu_lora

        return "cpu" if kind == "cpu" and cpu_lora.kernels() is not None else "torch"
    return value


class LoRAError(ValueError):
    """The adapter cannot be served (400): the message names what is wrong."""
    status = 400


class LoRANotFound(LoRAError):
    """No adapter at the path (404, as vLLM answers)."""
    status = 404


@attrs.frozen
class AdapterConfig:
    path: str
    r: int
    scale: float                      # lora_alpha / r, or / sqrt(r) with use_rslora
    targets: frozenset[str]           # HF module names (q_proj ...)


def model_targets(mc: ModelConfig) -> tuple[str, ...]:
    """The HF linears of the model an adapter may patch (a mixture of experts has no dense MLP)."""
    return tuple(t for t in TARGETS if not (mc.num_experts and t in _MLP))


def read_adapter_config(path: str, mc: ModelConfig, max_rank: int) -> AdapterConfig:
    """adapter_config.json checked against the model and --max-lora-rank. Raises LoRANotFound
    (no such folder or file) or LoRAError naming what is not supported."""
    folder = Path(path).expanduser()
    cfg_file = folder / CONFIG_FILE
    if not folder.is_dir() or not cfg_file.is_file():
        raise LoRANotFound(f"No adapter found for {path}: expected a folder with {CONFIG_FILE} "
                           f"and {WEIGHTS_FILE}.")
    if not (folder / WEIGHTS_FILE).is_file():
        what = ("only safetensors weights are read, not adapter_model.bin"
                if (folder / "adapter_model.bin").is_file() else f"{WEIGHTS_FILE} is missing")
        raise LoRANotFound(f"No adapter weights found for {path}: {what}.")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise LoRAError(f"{cfg_file} is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_file} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"The adapter at {path} is a {cfg.get('peft_type')} adapter: only LORA is supported.")
    if cfg.get("use_dora"):
        raise LoRAError(f"The adapter at {path} uses DoRA (use_dora), which is not supported.")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"The adapter at {path} has modules_to_save {cfg['modules_to_save']}, "
                        "which is not supported: only LoRA's A and B matrices are.")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"The adapter at {path} trains biases (bias: {cfg['bias']!r}), which is not supported.")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAError(f"The adapter at {path} has a {key}, which is not supported.")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"The adapter at {path} has no valid rank 'r': {r!r}.")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"The adapter at {path} has no valid 'lora_alpha': {alpha!r}.")
    if r > max_rank:
        raise LoRAError(f"LoRA rank {r} of the adapter at {path} is greater than "
                        f"--max-lora-rank {max_rank}.")
    have = model_targets(mc)
    targets = _targets(cfg.get("target_modules"), have, mc, path)
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return AdapterConfig(str(folder), r, float(scale), frozenset(targets))


def _targets(value, have: tuple[str, ...], mc: ModelConfig, path: str) -> set[str]:
    if value == "all-linear":
        return set(have)
    if isinstance(value, str):      # PEFT: a regex over full module names
        names = {t: f"model.layers.0.{TARGETS[t][0].split('.')[0]}.{t}" for t in TARGETS}
        found = {t for t, full in names.items() if re.fullmatch(value, full)}
        if not found:
            raise LoRAError(f"The adapter at {path}: target_modules {value!r} matches none of "
                            f"the model's linears ({', '.join(have)}).")
        value = sorted(found)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise LoRAError(f"The adapter at {path} has no valid target_modules: {value!r}.")
    short = {v.rsplit(".", 1)[-1] for v in value}
    missing = sorted(short - set(have))
    if missing:
        raise LoRAError(f"The adapter at {path} targets module(s) {', '.join(missing)}, which the "
                        f"model ({mc.architecture}) lacks or LoRA does not support here: "
                        f"supported are {', '.join(have)}.")
    return short


@attrs.frozen(eq=False)
class Adapter:
    """One adapter's weights, per patched linear (layer, our name): A^T [in, R] and
    (scale * B)^T [R, out], B laid at its slices' columns of the merged output."""
    ref: LoRARef
    weights: dict
    nbytes: int


def _slices(model, attr: str) -> list[int]:
    """The output widths of a merged linear's parts (q, k, v / gate, up), or [out]."""
    layer = model.layers[0]
    if attr == "self_attn.qkv_proj":
        return list(layer.self_attn.split)
    if attr == "mlp.gate_up_proj":
        half = layer.mlp.gate_up_proj.out_features // 2
        return [half, half]
    return [layer.get_submodule(attr).out_features]


def _full_shape(mc: ModelConfig, name: str) -> tuple[int, int]:
    """The unsharded [out, in] of an HF linear of the model."""
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    d, i = mc.hidden_size, mc.intermediate_size
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
            "gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}[name]


def _shard(model, name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's part of an adapter's A [r, in] and B [out, r], sharded as
    the linear it patches (gpu/models/causal_lm.py): column-parallel q/k/v/gate/up keep B's rows of this
    rank's heads or intermediate slice (A whole); row-parallel o/down keep A's columns of this
    rank's input slice (B whole): each rank's partial (x_r A_r^T) B^T is summed by the
    layer's own all-reduce, as the base linear's partial output is."""
    tp = getattr(model, "tp", None)
    if tp is None or tp.size == 1:
        return a, b
    from gpu.models.causal_lm import kv_heads, q_heads

    mc, dh = model.config, model.config.head_dim
    if name in ("q_proj", "o_proj", "k_proj", "v_proj"):
        h0, h1 = q_heads(mc, tp) if name in ("q_proj", "o_proj") else kv_heads(mc, tp)
        lo, hi = h0 * dh, h1 * dh
    else:
        lo, hi = tp.split(mc.intermediate_size, "intermediate_size")
    if name in ("o_proj", "down_proj"):
        return a[:, lo:hi], b
    return a, b[lo:hi]


def load_adapter(ref: LoRARef, cfg: AdapterConfig, model, dtype: torch.dtype,
                 device: torch.device) -> Adapter:
    """The adapter's tensors, checked against the model (names, shapes, rank), as Adapter."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(Path(cfg.path) / WEIGHTS_FILE))
    except Exception as exc:
        raise LoRAError(f"cannot read {cfg.path}/{WEIGHTS_FILE}: {exc}") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise LoRAError(f"The adapter at {cfg.path} holds {key}, which is not a LoRA A/B "
                            f"matrix of a supported linear ({', '.join(TARGETS)}).")
        layer, name, ab = int(m.group(1)), m.group(2), m.group(3)
        if name not in cfg.targets:
            raise LoRAError(f"The adapter at {cfg.path} holds {key}, but {name} is not in its "
                            "target_modules.")
        if layer >= len(model.layers):
            raise LoRAError(f"The adapter at {cfg.path} holds {key}: the model has "
                            f"{len(model.layers)} layers.")
        parts.setdefault((layer, name), {})[ab] = t
    weights = {}
    nbytes = 0
    by_linear: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, name), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"The adapter at {cfg.path}: layer {layer} {name} lacks lora_A or lora_B.")
        a, b = ab["A"], ab["B"]
        attr, part = TARGETS[name]
        out, inp = _full_shape(model.config, name)
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != inp or b.shape[0] != out \
                or a.shape[0] != b.shape[1]:
            raise LoRAError(f"The adapter at {cfg.path}: layer {layer} {name} has A {tuple(a.shape)} "
                            f"and B {tuple(b.shape)}, which do not fit the model's "
                            f"[{out} x {inp}] linear (another base model's adapter?).")
        if a.shape[0] > cfg.r:
            raise LoRAError(f"The adapter at {cfg.path}: layer {layer} {name} has rank "
                            f"{a.shape[0]}, above its r {cfg.r}.")
        a, b = _shard(model, name, a, b)
        linear = model.layers[layer].get_submodule(attr)
        if a.shape[1] != linear.in_features or b.shape[0] != _slices(model, attr)[part or 0]:
            raise LoRAError(f"The adapter at {cfg.path}: layer {layer} {name} has A "
                            f"{tuple(ab['A'].shape)} and B {tuple(ab['B'].shape)}, which do not "
                            "fit the model's linear.")
        by_linear.setdefault((layer, attr), []).append((part or 0, a, b))
    for (layer, attr), items in by_linear.items():
        widths = _slices(model, attr)
        starts = [sum(widths[:i]) for i in range(len(widths))]
        rank = sum(a.shape[0] for _, a, _ in items)
        at = torch.empty(model.layers[layer].get_submodule(attr).in_features, rank, dtype=torch.float32)
        bt = torch.zeros(rank, sum(widths), dtype=torch.float32)
        r0 = 0
        for part, a, b in sorted(items, key=lambda it: it[0]):
            r = a.shape[0]
            at[:, r0:r0 + r] = a.float().T
            bt[r0:r0 + r, starts[part]:starts[part] + widths[part]] = b.float().T * cfg.scale
            r0 += r
        at, bt = at.to(device, dtype).contiguous(), bt.to(device, dtype).contiguous()
        weights[(layer, attr)] = (at, bt)
        nbytes += at.numel() * at.element_size() + bt.numel() * bt.element_size()
    return Adapter(ref, weights, nbytes)


class _Slots:
    """The Triton path's adapter weights: per hooked linear (layer, attr), A [S, R, in] and
    B [S, out, R] stacked over S = max_loras slots, R = max_rank * the linear's fused parts,
    and each slot's own rank there (`ranks`, the rows of A / columns of B the kernels read;
    0 where the adapter does not patch the linear). An adapter is copied into a slot when a step first
    needs it; a slot's adapter is replaced, least recently used first, only by a step that
    does not use it."""

    def __init__(self, model, keys, slots: int, max_rank: int, dtype, device) -> None:
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.ranks: dict[tuple[int, str], torch.Tensor] = {}   # [S] int32: the rank each slot holds
        for key in keys:
            linear = model.layers[key[0]].get_submodule(key[1])
            rank = max_rank * len(_slices(model, key[1]))
            self.a[key] = torch.zeros(slots, rank, linear.in_features, dtype=dtype, device=device)
            self.b[key] = torch.zeros(slots, linear.out_features, rank, dtype=dtype, device=device)
            self.ranks[key] = torch.zeros(slots, dtype=torch.int32, device=device)
        self.owner: list[int | None] = [None] * slots   # the adapter id held (ids are never reused)
        self.used = [0] * slots        # the step count at its last use (LRU)
        self.clock = 0

    def assign(self, adapters: list[Adapter]) -> list[int]:
        """Each adapter's slot, copying in those not resident."""
        self.clock += 1
        step = {ad.ref.id for ad in adapters}
        out = []
        for ad in adapters:
            s = next((i for i, o in enumerate(self.owner) if o == ad.ref.id), None)
            if s is None:
                free = [i for i, o in enumerate(self.owner) if o is None or o not in step]
                if not free:
                    raise RuntimeError(f"LoRA: a step uses more than {len(self.owner)} adapters "
                                       "(--max-loras)")
                s = min(free, key=lambda i: (self.owner[i] is not None, self.used[i]))
                self._write(s, ad)
            self.used[s] = self.clock
            out.append(s)
        return out

    def _write(self, s: int, ad: Adapter) -> None:
        for key, a in self.a.items():
            w = ad.weights.get(key)
            r = 0 if w is None else w[0].shape[1]
            if r:
                a[s, :r].copy_(w[0].T)
                self.b[key][s, :, :r].copy_(w[1].T)
            self.ranks[key][s] = r
        self.owner[s] = ad.ref.id


class LoRAManager:
    """The runner's LoRA state: hooks on every patchable linear, the loaded adapters (LRU of
    max_cpu_loras, the running ones pinned), each sequence's adapter and the step's row groups.
    Used from the runner thread, but `forget` (runtime unload), which the event loop calls."""

    def __init__(self, model, *, max_loras: int, max_cpu_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.dtype, self.device = dtype, torch.device(device)
        self.loaded: OrderedDict[int, Adapter] = OrderedDict()   # id -> weights, LRU first
        self.users: dict[int, int] = {}         # id -> running sequences that use it
        self.seq_lora: dict[str, LoRARef] = {}
        self._forgotten: set[int] = set()
        self._lock = threading.Lock()
        self._step: tuple[torch.Tensor, list[tuple[Adapter, int, int]]] | None = None
        self._index: tuple[torch.Tensor, set] | None = None   # triton: row -> slot, keys used
        self.num_loads = 0
        attrs_ = sorted({attr for t in model_targets(model.config) for attr in [TARGETS[t][0]]})
        keys = [(i, attr) for i in range(len(model.layers)) for attr in attrs_]
        self.backend = lora_backend(self.device)
        self._slots = (_Slots(model, keys, max_loras, max_rank, dtype, self.device)
                       if self.backend == "triton" else None)
        self._keys = {key: i for i, key in enumerate(keys)}    # the C kernel's table rows
        self._ptrs: dict[int, tuple] = {}      # adapter id -> (Adapter, table rows, packed weights)
        hook = self._triton_hook if self._slots is not None else self._hook
        self._hooks = [model.layers[i].get_submodule(attr).register_forward_hook(hook((i, attr)))
                       for i, attr in keys]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.loaded.clear()
        self._ptrs.clear()

    # -- sequences -------------------------------------------------------------------------
    def start(self, seq_id: str, ref: LoRARef) -> None:
        self.seq_lora[seq_id] = ref
        self.users[ref.id] = self.users.get(ref.id, 0) + 1

    def release(self, seq_id: str) -> None:
        ref = self.seq_lora.pop(seq_id, None)
        if ref is None:
            return
        left = self.users[ref.id] - 1
        if left:
            self.users[ref.id] = left
            return
        del self.users[ref.id]
        with self._lock:
            gone = ref.id in self._forgotten
            self._forgotten.discard(ref.id) if gone else None
        if gone:
            self.loaded.pop(ref.id, None)

    def forget(self, lora_id: int) -> None:
        """A runtime unload: drop the weights once no running sequence uses them (now if none)."""
        with self._lock:
            self._forgotten.add(lora_id)

    def _adapter(self, ref: LoRARef, busy=()) -> Adapter:
        ad = self.loaded.get(ref.id)
        if ad is not None:
            self.loaded.move_to_end(ref.id)
            return ad
        cfg = read_adapter_config(ref.path, self.model.config, self.max_rank)
        ad = load_adapter(ref, cfg, self.model, self.dtype, self.device)
        self.num_loads += 1
        self.loaded[ref.id] = ad
        for lid in list(self.loaded):     # LRU: evict idle adapters beyond max_cpu_loras
            if len(self.loaded) <= self.max_cpu_loras:
                break
            if lid not in self.users and lid not in busy:
                del self.loaded[lid]
        return ad

    # -- steps ---------------------------------------------------------------------------
    def groups(self, chunks) -> tuple:
        """The step's LoRA rows: ((LoRARef, ((start, stop), ...)), ...) per adapter, in the
        order of its first row; () when no row uses an adapter. Plain data: under tensor
        parallelism rank 0 broadcasts it to the workers (gpu/worker/tp.py)."""
        with self._lock:
            idle = [i for i in self._forgotten if i not in self.users]
            self._forgotten.difference_update(idle)
        for i in idle:
            self.loaded.pop(i, None)
        if not self.seq_lora:
            return ()
        rows: dict[int, list[tuple[int, int]]] = {}
        refs: dict[int, LoRARef] = {}
        row = 0
        for c in chunks:
            n = len(c.token_ids)      # a verify chunk's drafts included: every row its adapter's
            ref = self.seq_lora.get(c.seq_id)
            if ref is not None:
                rows.setdefault(ref.id, []).append((row, row + n))
                refs[ref.id] = ref
            row += n
        return tuple((refs[lid], tuple(rs)) for lid, rs in rows.items())

    def set_step(self, groups) -> bool:
        """Sort the step's LoRA rows by adapter (`perm`) and load the adapters the step uses.
        False: no LoRA row."""
        self._step = self._index = None
        if not groups:
            return False
        if self._slots is not None:
            return self._set_index(groups)
        perm: list[int] = []
        spans = []
        busy = {ref.id for ref, _ in groups}
        for ref, rs in groups:
            a = len(perm)
            for r0, r1 in rs:
                perm.extend(range(r0, r1))
            spans.append((self._adapter(ref, busy), a, len(perm)))
        packed = None
        if self.backend == "cpu":   # bounds [G + 1] and the pointer table [G, keys, 3]
            for lid in [lid for lid, (ad, *_) in self._ptrs.items() if self.loaded.get(lid) is not ad]:
                del self._ptrs[lid]     # evicted (a reload is a new Adapter): its pointers are stale
            table = torch.stack([self._pointers(ad) for ad, _, _ in spans])
            packed = (torch.tensor([0] + [b for _, _, b in spans], dtype=torch.int64), table)
        self._step = (torch.tensor(perm, dtype=torch.int64, device=self.device), spans, packed)
        return True

    def _pointers(self, ad: Adapter) -> torch.Tensor:
        from gpu.kernels.cpu.lora import LoRAKernels, kernels

        cached = self._ptrs.get(ad.ref.id)
        if cached is None or cached[0] is not ad:    # packed once per load, kept beside the weights
            packed = kernels().pack(ad.weights)
            cached = self._ptrs[ad.ref.id] = (ad, LoRAKernels.pointers(packed, list(self._keys)), packed)
        return cached[1]

    def _set_index(self, groups) -> bool:
        """Triton: the step's row -> slot index over its rows up to the last LoRA row."""
        busy = {ref.id for ref, _ in groups}
        adapters = [self._adapter(ref, busy) for ref, _ in groups]
        slots = self._slots.assign(adapters)
        index = [-1] * max(r1 for _, rs in groups for _, r1 in rs)
        for s, (_, rs) in zip(slots, groups):
            for r0, r1 in rs:
                index[r0:r1] = [s] * (r1 - r0)
        keys = set().union(*(ad.weights for ad in adapters))
        self._index = (torch.tensor(index, dtype=torch.int32, device=self.device), keys)
        return True

    def prepare(self, chunks) -> bool:
        """The step's row groups: rows of each adapter, sorted by adapter. False: no LoRA row."""
        return self.set_step(self.groups(chunks))

    def done(self) -> None:
        self._step = self._index = None

    def _triton_hook(self, key: tuple[int, str]):
        from gpu.kernels.triton.lora import lora_expand, lora_shrink

        a, b, ranks = self._slots.a[key], self._slots.b[key], self._slots.ranks[key]

        def hook(module, args, out):
            step = self._index
            if step is None or key not in step[1]:
                return out
            index = step[0]
            n = len(index)
            x = args[0][:n]
            if x.stride(-1) != 1:
                x = x.contiguous()
            h = lora_shrink(x, a, index, ranks)
            rows = out[:n]
            if rows.stride(-1) == 1:
                lora_expand(h, b, index, rows, ranks)
            else:
                rows.copy_(lora_expand(h, b, index, rows.contiguous(), ranks))
            return out
        return hook

    def _hook(self, key: tuple[int, str]):
        kernel, row = None, self._keys[key]
        if self.backend == "cpu":
            from gpu.kernels.cpu.lora import kernels

            kernel = kernels()

        def hook(module, args, out):
            step = self._step
            if step is None:
                return out
            perm, spans, packed = step
            if packed is not None and kernel.apply(args[0], out, perm, packed[0], packed[1], row,
                                                   self.dtype):
                return out
            xs = args[0].index_select(0, perm)
            if xs.dtype != self.dtype:
                xs = xs.to(self.dtype)
            delta = torch.zeros(len(perm), out.shape[-1], dtype=self.dtype, device=out.device)
            for ad, a, b in spans:
                w = ad.weights.get(key)
                if w is not None:
                    torch.matmul(xs[a:b] @ w[0], w[1], out=delta[a:b])
            return out.index_add_(0, perm, delta.to(out.dtype))
        return hook
