"""Speculative decoding with an EAGLE head (`"method": "eagle"` and `"eagle3"`): the runner's half.

An EAGLE head is a small decoder (one Llama layer, as published) that drafts from the
target's own hidden states: at position p it reads the embedding of token p + 1 and the
target's hidden state at p, and its logits propose token p + 2. Later drafts feed back the
head's own hidden state. The scheduler plans the drafts as DRAFT placeholders exactly as
for a draft model (stages/schedule/drafter.py ModelDrafter); `EagleDrafter.fill` writes
them before the verify forward, so the target decides every token as for any draft.

- **EAGLE-1** (`fc` over [embedding; hidden]): the target's last hidden state (after its
  final norm) is the input; layer 0 has no input norm; no final norm; the logits are the
  target's LM head over the head's output. Embeddings are the target's unless the
  checkpoint has its own.
- **EAGLE3**: the target keeps the residual stream entering three of its layers
  (`eagle_aux_hidden_state_layer_ids`, else vLLM's default 2, L // 2, L - 3; CausalLM's
  aux_layers), and `fc` maps their concatenation to the head's width. Layer 0's attention
  reads [input_layernorm(embedding); hidden_norm(hidden)] (2 x hidden wide), its residual
  is the hidden state (normed first with `norm_before_residual`); a final `norm`, and the
  head's own `lm_head` over a draft vocabulary of `draft_vocab_size` tokens, mapped to
  the target's by `d2t` (target id = draft id + d2t[draft id]; every other token -inf).
- **Formats**: the EAGLE/EAGLE3 folders (`LlamaForCausalLMEagle3`, `midlayer.*` or
  `layers.0.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`) and the speculators format
  (config.json with `speculators_config`, `speculators_model_type: eagle3` and the layer's
  config in `transformer_layer_config`; RedHat's speculators). Weights from *.safetensors
  or pytorch_model.bin.
- **Its own KV cache**, addressed by the target's block tables (as gpu/worker/spec_decode/draft.py's).
- **The target's hidden states**: each step's rows are kept per sequence (`pending`: the
  positions whose hidden state the head has not read yet); a verify keeps those of the
  accepted run only. The next step that drafts runs the head over them first (its KV
  written), then drafts from the last one. Steps without drafts leave them pending, up to
  PENDING_LIMIT rows a sequence, then the head catches up anyway.
"""
from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import torch
from torch import nn

from gpu.models.registry import config_from_hf
from gpu.layers.attention import KVCache, TorchPagedAttention
from gpu.config.model import ModelConfig
from gpu.worker.cuda_graphs import run_graphed
from gpu.worker.spec_decode.draft import DraftError, tokens_of
from gpu.interface import SeqChunk, StepPlan
from gpu.models.causal_lm import CausalLM, DecoderLayer, Linear, RMSNorm
from gpu.layers.ops import build_rope_cache, fused_add_rms_norm, rms_norm, skip_init
from gpu.worker.sampler import DraftRow, SeqSamplingState, apply_logit_controls, sample
from gpu.worker.staging import BlockTables, HostInputs, prepare_step
from gpu.formats.hf import read_json

# a sequence's target hidden states left unread by the head after this many rows are read
# at the next step even when it drafts nothing (bounds what waits for a gated-off head)
PENDING_LIMIT = 64


class HeadError(DraftError):
    """An EAGLE head that cannot draft for this target (start-up refuses it)."""


@attrs.frozen
class HeadSpec:
    """What config.json (and the tensors' names) say about a head."""
    kind: str                     # "eagle" | "eagle3"
    path: str
    layer: ModelConfig            # the head's decoder layer(s)
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    aux_layer_ids: tuple[int, ...]    # eagle3: the target layers it reads
    para_norm: bool               # eagle (HASS): norms on the embedding and hidden inputs
    files: tuple[Path, ...]
    torch_bin: bool               # pytorch_model.bin rather than safetensors


def _fail(path, msg: str) -> HeadError:
    return HeadError(f"--speculative-config: the EAGLE head {path} {msg}")


def _files(d: Path) -> tuple[tuple[Path, ...], bool]:
    from gpu.formats.hf import safetensors_files
    try:
        return tuple(safetensors_files(d)), False
    except FileNotFoundError:
        bins = sorted(d.glob("pytorch_model*.bin"))
        if bins:
            return tuple(bins), True
        raise _fail(d, "has no weights (no *.safetensors, no pytorch_model.bin)") from None


def read_head(path: str, method: str, target: ModelConfig, weights: bool = True) -> HeadSpec:
    """The head's config, checked against `method` and the target: a missing folder or
    config.json, another vocabulary, hidden states of another size, aux layers the target
    does not have, each a HeadError that names it; and (weights) a folder without weights
    (the GPU stand-in reads a head's config alone: gpu/worker/simulate.py StandInDraft)."""
    d = Path(path).expanduser()
    if not d.exists():
        raise _fail(path, "does not exist")
    if not d.is_dir():
        raise _fail(path, "is not a folder (an EAGLE head is a Hugging Face folder)")
    cfg = read_json(d / "config.json")
    if not cfg:
        raise _fail(path, "has no config.json")
    if "speculators_config" in cfg or "speculators_model_type" in cfg:
        kind = cfg.get("speculators_model_type")
        if kind not in ("eagle3",):
            raise _fail(path, f"is a speculators checkpoint of type {kind!r}; supported: eagle3")
        layer_d = cfg.get("transformer_layer_config")
        if not isinstance(layer_d, dict):
            raise _fail(path, "has no transformer_layer_config (speculators format)")
        norm_before_residual = bool(cfg.get("norm_before_residual", True))
        if cfg.get("norm_before_fc"):
            raise _fail(path, "asks for norm_before_fc, which is not supported")
    else:
        archs = " ".join(cfg.get("architectures") or ()).lower()
        kind = "eagle3" if "eagle3" in archs else "eagle" if "eagle" in archs else method
        layer_d = cfg
        norm_before_residual = bool(cfg.get("norm_before_residual", False))
    if kind != method:
        raise _fail(path, f'is an {kind.upper()} head: use "method": "{kind}", not "{method}"')
    try:
        layer = config_from_hf({**layer_d, "model_type": "llama"})
    except KeyError as exc:
        raise _fail(path, f"has no {exc.args[0]} in its config") from None
    except ValueError as exc:
        raise _fail(path, f"has a config tailrace cannot use: {exc}") from None
    if layer.vocab_size != target.vocab_size:
        raise _fail(path, f"has a vocabulary of {layer.vocab_size} tokens, the target "
                          f"{target.vocab_size}: a head must share the target's vocabulary")
    th = int(cfg.get("target_hidden_size") or layer_d.get("target_hidden_size")
             or layer.hidden_size)
    if kind == "eagle" and layer.hidden_size != target.hidden_size:
        raise _fail(path, f"has a hidden size of {layer.hidden_size}, the target "
                          f"{target.hidden_size}: an EAGLE head reads the target's hidden states")
    if th != target.hidden_size:
        raise _fail(path, f"is for a target of hidden size {th} (target_hidden_size), "
                          f"this target's is {target.hidden_size}")
    draft_vocab = int(cfg.get("draft_vocab_size") or layer_d.get("draft_vocab_size")
                      or layer.vocab_size)
    if not 0 < draft_vocab <= layer.vocab_size:
        raise _fail(path, f"has draft_vocab_size {draft_vocab}, more than its vocabulary "
                          f"{layer.vocab_size}")
    L = target.num_hidden_layers
    ids: tuple[int, ...] = ()
    if kind == "eagle3":
        given = (cfg.get("eagle_aux_hidden_state_layer_ids")
                 or layer_d.get("eagle_aux_hidden_state_layer_ids")
                 or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        ids = tuple(int(i) for i in given) if given else (2, L // 2, L - 3)
        bad = [i for i in ids if not 0 <= i <= L]
        if bad:
            why = "its eagle_aux_hidden_state_layer_ids" if given else "vLLM's default aux layers"
            raise _fail(path, f"reads target layers {list(ids)} ({why}); the target has {L} "
                              "layers (ids 0.." f"{L})")
    files, torch_bin = _files(d) if weights else ((), False)
    return HeadSpec(kind, str(path), layer, draft_vocab, th, norm_before_residual, ids,
                    bool(cfg.get("add_para_norm", False)), files, torch_bin)


def _tensors(spec: HeadSpec):
    """(our name, tensor): checkpoint names without a `model.` prefix, `midlayer.` as
    layers.0, speculators' `fusion_fc` as fc."""
    if spec.torch_bin:
        items = (kv for f in spec.files for kv in torch.load(f, map_location="cpu",
                                                             weights_only=True).items())
    else:
        from gpu.formats.hf import named_tensors
        items = named_tensors(list(spec.files))
    for name, t in items:
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        name = {"fusion_fc.weight": "fc.weight", "fusion_fc.bias": "fc.bias"}.get(name, name)
        yield name, t


_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class EagleHead(nn.Module):
    """The head's modules (module docstring), its weights loaded from the checkpoint; the
    target's embeddings (and, for EAGLE-1, LM head) when the checkpoint has none."""

    def __init__(self, spec: HeadSpec, target: CausalLM, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.spec = spec
        self.kind = spec.kind
        c = self.config = spec.layer
        H = c.hidden_size
        kw = dict(dtype=dtype, device=device)
        self.residual_dtype = target.residual_dtype if dtype == target.dtype else dtype
        tensors = dict(_tensors(spec))
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, device) for i in range(c.num_hidden_layers))
        first = self.layers[0]
        if self.kind == "eagle3":
            attn = first.self_attn
            attn.qkv_proj = skip_init(Linear, 2 * H, sum(attn.split), bias=c.attention_bias, **kw)
            first.hidden_norm = RMSNorm(H, c.rms_norm_eps, **kw)
            fc_in = len(spec.aux_layer_ids) * spec.target_hidden_size
            self.fc = skip_init(Linear, fc_in, H, bias="fc.bias" in tensors, **kw)
            self.norm = RMSNorm(H, c.rms_norm_eps, **kw)
        else:
            self.fc = skip_init(Linear, 2 * H, H, bias="fc.bias" in tensors, **kw)
            if spec.para_norm:
                self.embedding_layernorm = RMSNorm(H, c.rms_norm_eps, **kw)
                self.hidden_states_layernorm = RMSNorm(H, c.rms_norm_eps, **kw)
        # the embeddings: the checkpoint's own, or the target's
        self.embed_tokens = None
        if "embed_tokens.weight" in tensors:
            self.embed_tokens = nn.Embedding(c.vocab_size, H, _weight=torch.empty(c.vocab_size, H, **kw))
        elif target.config.hidden_size != H:
            raise _fail(spec.path, f"has no embed_tokens.weight and a hidden size of {H}, the "
                                   f"target {target.config.hidden_size}: it cannot share the "
                                   "target's embeddings")
        self.target = [target]        # not a submodule: its weights are the target's
        self.lm_head = None
        if self.kind == "eagle3":
            if "lm_head.weight" in tensors:
                self.lm_head = skip_init(Linear, H, spec.draft_vocab_size, bias=False, **kw)
            elif spec.draft_vocab_size != c.vocab_size or target.config.hidden_size != H:
                raise _fail(spec.path, "has no lm_head.weight (an EAGLE3 head with its own "
                                       "draft vocabulary or width needs its own)")
            d2t = tensors.get("d2t")
            if d2t is not None and tuple(d2t.shape) != (spec.draft_vocab_size,):
                raise _fail(spec.path, f"has d2t of shape {tuple(d2t.shape)}, expected "
                                       f"({spec.draft_vocab_size},)")
            if d2t is None and spec.draft_vocab_size != c.vocab_size:
                raise _fail(spec.path, f"has a draft vocabulary of {spec.draft_vocab_size} "
                                       "tokens and no d2t map to the target's")
            self.register_buffer("draft_to_target", None if d2t is None else (
                torch.arange(spec.draft_vocab_size) + d2t.long()).to(device), persistent=False)
            if self.draft_to_target is not None and (
                    int(self.draft_to_target.min()) < 0
                    or int(self.draft_to_target.max()) >= c.vocab_size):
                raise _fail(spec.path, "has a d2t map to tokens outside the vocabulary")
        self.register_buffer("cos_sin", build_rope_cache(c, c.max_position_embeddings, device),
                             persistent=False)
        self._load(tensors)

    def _shards(self, layer: int, merged: str) -> list[int]:
        """The row counts of a merged projection's parts (q, k, v or gate, up)."""
        L = self.layers[layer]
        if merged == "qkv_proj":
            return list(L.self_attn.split)
        return [L.mlp.down_proj.in_features] * 2

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, t in tensors.items():
            if name in ("d2t", "t2d") or name.endswith("rotary_emb.inv_freq"):
                continue
            if self.kind == "eagle" and name in ("lm_head.weight", "layers.0.input_layernorm.weight"):
                continue            # EAGLE-1: the target's LM head; layer 0 has no input norm
            prefix, _, leaf = name.rpartition(".")
            parent, _, module = prefix.rpartition(".")
            rows, key = slice(None), name
            if module in _STACKED and parent.startswith("layers."):
                merged, shard = _STACKED[module]
                sizes = self._shards(int(parent.split(".")[1]), merged)
                start = sum(sizes[:shard])
                rows = slice(start, start + sizes[shard])
                name = f"{parent}.{merged}.{leaf}"
                key = f"{name}:{shard}"
            if name not in params:
                raise _fail(self.spec.path, f"has an unexpected weight {key.split(':')[0]!r} "
                                            f"for an {self.kind.upper()} head")
            dst = params[name].data[rows]
            if tuple(dst.shape) != tuple(t.shape):
                raise _fail(self.spec.path, f"has weight {name!r} of shape {tuple(t.shape)}, "
                                            f"expected {tuple(dst.shape)} (a head for a model of "
                                            "other sizes?)")
            with torch.no_grad():
                dst.copy_(t)
            filled.add(key)
        want = set()
        for name in params:
            if self.kind == "eagle" and name == "layers.0.input_layernorm.weight":
                continue
            module = name.rpartition(".")[0].rpartition(".")[2]
            parts = {"qkv_proj": 3, "gate_up_proj": 2}.get(module)
            want.update([name] if parts is None else [f"{name}:{i}" for i in range(parts)])
        missing = sorted(want - filled)
        if missing:
            raise _fail(self.spec.path, f"is missing {len(missing)} weights, e.g. "
                                        f"{[m.split(':')[0] for m in missing[:4]]}")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        return self.target[0].embed(ids)

    def combine(self, target_hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """What the head reads of one target step's rows [T, H]: EAGLE3 fc over the aux
        layers' states, EAGLE-1 the final hidden state."""
        if self.kind == "eagle3":
            return self.fc(aux).to(self.residual_dtype)
        return target_hidden.to(self.residual_dtype)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attn
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] (the token after each position), hidden [T, H] (combine's, or the head's
        own from the position before) -> (the rows for the logits, the rows fed back)."""
        e = self.embed(ids).to(self.residual_dtype)
        cs = self.cos_sin
        first = self.layers[0]
        if self.kind == "eagle3":
            en = first.input_layernorm
            e = rms_norm(e, en.weight, en.eps)
            hn = first.hidden_norm
            if self.spec.norm_before_residual:
                h = rms_norm(hidden, hn.weight, hn.eps)
                residual = h
            else:
                residual = hidden
                h = rms_norm(hidden, hn.weight, hn.eps)
            a = first.self_attn(torch.cat([e, h], dim=-1), positions, cs, attn)
            pn = first.post_attention_layernorm
            x, residual = fused_add_rms_norm(a.to(residual.dtype), residual, pn.weight, pn.eps)
            x = first.mlp(x)
            for layer in self.layers[1:]:
                x, residual = layer(x, residual, positions, cs, attn)
            normed, prenorm = fused_add_rms_norm(x.to(residual.dtype), residual,
                                                 self.norm.weight, self.norm.eps)
            return normed, prenorm
        if self.spec.para_norm:
            e = rms_norm(e, self.embedding_layernorm.weight, self.embedding_layernorm.eps)
            hidden = rms_norm(hidden, self.hidden_states_layernorm.weight,
                              self.hidden_states_layernorm.eps)
        x = self.fc(torch.cat([e, hidden.to(e.dtype)], dim=-1)).to(self.residual_dtype)
        residual = x            # layer 0 has no input norm (EAGLE's cnets)
        a = first.self_attn(x, positions, cs, attn)
        pn = first.post_attention_layernorm
        x, residual = fused_add_rms_norm(a.to(residual.dtype), residual, pn.weight, pn.eps)
        x = first.mlp(x)
        for layer in self.layers[1:]:
            x, residual = layer(x, residual, positions, cs, attn)
        out = x.to(residual.dtype) + residual
        return out, out

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, V] over the target's vocabulary (EAGLE3: the draft vocabulary's logits put at
        their target ids by d2t, every other token -inf)."""
        if self.lm_head is None:
            return self.target[0].compute_logits(rows)
        logits = self.lm_head(rows).float()
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full


def head_kv_bytes_per_block(spec: HeadSpec, block_size: int, dtype: torch.dtype) -> int:
    c = spec.layer
    return KVCache.bytes_per_block(c.num_hidden_layers, block_size, c.num_key_value_heads,
                                   c.head_dim, dtype)


class EagleDrafter:
    """The head, its KV cache, and per sequence the target's hidden states it has not read
    yet; the runner's drafter for methods eagle and eagle3 (ModelRunner's `draft`)."""

    reads_hidden = True              # `captured` after every target forward
    cost = None                      # a head's cost a token is not modelled (the gate measures it)

    def __init__(self, head: EagleHead, cache: KVCache, device: torch.device,
                 use_triton: bool = False) -> None:
        self.head = head
        self.cache = cache
        self.device = device
        scale = head.config.head_dim ** -0.5
        if use_triton:
            from gpu.layers.attention import TritonPagedAttention
            self.attn = TritonPagedAttention(cache, scale)
        else:
            self.attn = TorchPagedAttention(cache, scale)
        self.tables = BlockTables()
        # seq id -> (first position, [r, H] rows): the target's states at positions the
        # head has not read, in order, up to the sequence's last token's position
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}
        self.forwards = 0
        self.replays = 0           # ... of them, graph replays (`capture`)
        self.graphs = self.verify_graphs = None
        self.drafted = 0           # drafts written from the head (not filler): for tests

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.spec.aux_layer_ids

    def release(self, seq_id: str) -> None:
        self.pending.pop(seq_id, None)
        self.tables.release(seq_id)

    def capture(self, *, max_bs: int, max_model_len: int, verify_tokens: int = 0) -> None:
        """CUDA graphs for the head's forwards, at the runner's batch sizes: decode graphs
        for those on its own fed-back state (one token a sequence), and verify-shaped ones
        of `verify_tokens` rows a sequence for its first forward of a step, which reads the
        target states it has not read (after a verify, the accepted run's: at most K + 1);
        more than that (a prompt's) runs eagerly (gpu/worker/cuda_graphs.py HeadGraphs,
        HeadVerifyGraphs)."""
        from gpu.worker.cuda_graphs import HeadGraphs, HeadVerifyGraphs, capture_graphs
        self.graphs, self.verify_graphs = capture_graphs(
            self.head, self.attn, max_bs=max_bs, max_model_len=max_model_len, device=self.device,
            verify_tokens=verify_tokens, label="the EAGLE head's ",
            kinds=(HeadGraphs, HeadVerifyGraphs))

    def overwritten(self, blocks) -> None:
        """Target blocks whose KV came from elsewhere (a remote prefill's read): nothing of
        the head's depends on them (its KV is its own pool's, computed from hidden states)."""

    def captured(self, chunks, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        """A target step's rows, appended to each chunk's sequence's pending states (a
        verify's are cut back to the accepted run by `verified`)."""
        rows = self.head.combine(hidden, aux)
        at = 0
        for c in chunks:
            n = len(c.token_ids)
            new = rows[at:at + n].clone()
            at += n
            have = self.pending.get(c.seq_id)
            if have is not None:
                start, old = have
                keep = c.start_pos - start
                if 0 <= keep <= len(old):
                    self.pending[c.seq_id] = (start, torch.cat([old[:keep], new]))
                    continue
            self.pending[c.seq_id] = (c.start_pos, new)

    def verified(self, seq_id: str, start_pos: int, emitted: int) -> None:
        """A verify at `start_pos` kept `emitted` tokens: the target's states past the
        accepted run were computed from rejected drafts."""
        have = self.pending.get(seq_id)
        if have is not None:
            start, rows = have
            self.pending[seq_id] = (start, rows[:max(0, start_pos + emitted - start)])

    def _forward(self, chunks: list[SeqChunk], hidden: torch.Tensor):
        input_ids, positions, meta, sample_idx = prepare_step(
            tuple(chunks), self.cache.block_size, self.device, block_tables=self.tables)
        out = run_graphed(self.graphs, self.verify_graphs, input_ids, positions, meta, feed=hidden)
        if out is None:
            self.attn.prepare(meta)
            normed, fed = self.head(input_ids, positions, hidden, self.attn)
        else:
            normed, fed = out
            self.replays += 1
        self.forwards += 1
        if not any(c.sample for c in chunks):
            return None, None
        return (self.head.compute_logits(normed.index_select(0, sample_idx)),
                fed.index_select(0, sample_idx))

    def fill(self, plan: StepPlan, host: HostInputs | None,
             states: dict[str, SeqSamplingState]) -> StepPlan:
        """Draft the plan's DRAFT placeholders: the head first reads each drafting
        sequence's pending target states (and those of sequences with PENDING_LIMIT rows
        waiting), sampling at the last; then K - 1 forwards on its own states."""
        drafting = any(c.num_drafts for c in plan.chunks)
        first: list[SeqChunk] = []
        feeds: list[torch.Tensor] = []
        verify: list[int] = []            # chunks whose drafts come from the head
        for i, c in enumerate(plan.chunks):
            have = self.pending.get(c.seq_id)
            if have is None or not len(have[1]):
                continue
            start, rows = have
            if not (c.num_drafts or (drafting and len(rows) >= 1) or len(rows) >= PENDING_LIMIT):
                continue
            # the head reads positions [start, start + r): the token after each is known
            r = min(len(rows), c.start_pos - start)
            if r <= 0:
                continue
            st = states[c.seq_id]
            toks = tokens_of(st, start + 1, start + 1 + r)
            if len(toks) != r:
                continue
            samples = bool(c.num_drafts) and start + r == c.start_pos
            first.append(SeqChunk(c.seq_id, tuple(toks), start, c.block_table, samples))
            feeds.append(rows[:r])
            self.pending[c.seq_id] = (start + r, rows[r:])
            if samples:
                verify.append(i)
        drafted: dict[int, list[int]] = {}
        if first:
            with torch.inference_mode():
                logits, fed = self._forward(first, torch.cat(feeds))
                chunks = [plan.chunks[i] for i in verify]
                out: list[list[int]] = [[] for _ in chunks]
                live = list(range(len(chunks)))
                while live:
                    rows_ = [DraftRow(states[chunks[j].seq_id], tuple(out[j])) for j in live]
                    picked = sample(apply_logit_controls(logits, rows_).float().cpu(), rows_)
                    for j, tok in zip(live, picked):
                        out[j].append(tok)
                    keep = [n for n, j in enumerate(live) if len(out[j]) < chunks[j].num_drafts]
                    live = [live[n] for n in keep]
                    if not live:
                        break
                    step = [SeqChunk(chunks[j].seq_id, (out[j][-1],),
                                     chunks[j].start_pos + len(out[j]) - 1, chunks[j].block_table,
                                     True) for j in live]
                    logits, fed = self._forward(step, fed[keep])
                drafted = dict(zip(verify, out))
        if not drafted and not drafting:
            return plan
        new = list(plan.chunks)
        for i, c in enumerate(plan.chunks):
            if not c.num_drafts:
                continue
            # no head input for this sequence (cannot happen on the eager path): the last
            # token repeated, which the verify simply rejects or accepts
            d = drafted.get(i) or [c.token_ids[0]] * c.num_drafts
            self.drafted += len(drafted.get(i, ()))
            new[i] = attrs.evolve(c, token_ids=(c.token_ids[0], *d))
            if host is not None:
                at = host.q_starts[i] + 1
                host.ids[at:at + len(d)] = np.asarray(d, dtype=np.int64)
        return attrs.evolve(plan, chunks=tuple(new))


def load_head(path: str, method: str, target: CausalLM, dtype: torch.dtype, device) -> EagleHead:
    spec = read_head(path, method, target.config)
    try:
        return EagleHead(spec, target, dtype, device)
    except (OSError, KeyError, RuntimeError) as exc:
        raise _fail(path, f"cannot be loaded: {exc}") from exc
