"""BERT / RoBERTa encoders over flat token batches (issue 32): the backbone of embedding
models (all-MiniLM-L6-v2, BGE, E5) and cross-encoders.

Sequences are concatenated along T with no batch axis, as in gpu/models/causal_lm.py; the attention
backend (gpu/layers/pooler.py VarlenAttention) knows where each sequence starts and attends
bidirectionally within it. Nothing is cached: a sequence is computed whole in one step.

Each layer, as transformers' BertLayer: attention (q/k/v merged into one projection at
load time, softmax(q k^T / sqrt(Dh)) v over the whole sequence), output projection, then
LayerNorm(x + attn) (post-LayerNorm); the MLP (GELU), then LayerNorm(h + mlp). The
embeddings add word, absolute position and token type embeddings and LayerNorm them.
RoBERTa differs only in its positions, which start at pad_token_id + 1, and in its
classification head. Dropout is inference's identity.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from gpu.models.causal_lm import _ONEDNN, _PACKABLE, Linear
from gpu.config.pooling import encoder_type
from gpu.layers.ops import skip_init

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


@attrs.frozen
class EncoderConfig:
    architecture: str               # bert | roberta | xlm-roberta
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_offset: int = 0        # RoBERTa: positions start at pad_token_id + 1

    def __attrs_post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_positions(self) -> int:
        """Tokens a sequence may have (RoBERTa's first positions are its padding's)."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> EncoderConfig:
        arch = encoder_type(d)
        if arch is None:
            raise ValueError(f"not an encoder config: model_type {d.get('model_type')!r}")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {d['position_embedding_type']!r} is not supported")
        roberta = arch != "bert"
        return cls(architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                   intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
                   num_attention_heads=d["num_attention_heads"],
                   max_position_embeddings=d["max_position_embeddings"],
                   type_vocab_size=d.get("type_vocab_size", 2),
                   layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
                   hidden_act=d.get("hidden_act", "gelu"),
                   position_offset=(int(d.get("pad_token_id", 1)) + 1) if roberta else 0)


class _FusedLinear(Linear):
    """A Linear whose CPU GEMM takes a oneDNN post-op, applied to each output tile while it
    is in cache (measured at all-MiniLM-L6-v2's shapes: the GELU 10%, the residual add 13%
    off the layer's time, within 1e-5 of the separate ops); elsewhere the separate ops."""

    def _onednn(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed weight, when this call can run through oneDNN."""
        w = self.weight
        if x.device.type != "cpu" or w.dtype not in _PACKABLE or not _ONEDNN or x.dtype != w.dtype:
            return None
        version = 0 if w.is_inference() else w._version
        if self._packed is None or self._packed_version != version:
            with torch.inference_mode():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._packed_version = version
        return self._packed


class GeluLinear(_FusedLinear):
    """Linear, then exact (erf) GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._onednn(x)
        if packed is None:
            return F.gelu(super().forward(x))
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "gelu", [], "none")


class AddLinear(_FusedLinear):
    """Linear, plus a residual: forward(x, residual)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        packed = self._onednn(x)
        if packed is None or residual.dtype != x.dtype or not residual.is_contiguous():
            return super().forward(x) + residual
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, self.bias, "add")


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class EncoderLayer(nn.Module):
    def __init__(self, c: EncoderConfig, idx: int, dtype, device):
        super().__init__()
        self.idx = idx
        self.num_heads, self.head_dim = c.num_attention_heads, c.head_dim
        kw = dict(dtype=dtype, device=device)
        D = c.hidden_size
        self.qkv_proj = skip_init(Linear, D, 3 * D, bias=True, **kw)
        self.o_proj = skip_init(AddLinear, D, D, bias=True, **kw)
        self.attn_norm = LayerNorm(D, c.layer_norm_eps, **kw)
        fused = c.hidden_act == "gelu"       # up_proj applies the activation itself
        self.up_proj = skip_init(GeluLinear if fused else Linear, D, c.intermediate_size, bias=True, **kw)
        self.down_proj = skip_init(AddLinear, c.intermediate_size, D, bias=True, **kw)
        self.mlp_norm = LayerNorm(D, c.layer_norm_eps, **kw)
        self.act = (lambda h: h) if fused else ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor, attn) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).view(T, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, Dh] x3
        o = attn.forward(self.idx, q, k, v)                                             # [T, H, Dh]
        h = self.attn_norm(self.o_proj(o.reshape(T, -1), x))
        return self.mlp_norm(self.down_proj(self.act(self.up_proj(h)), h))


class Encoder(nn.Module):
    """Parameters start uninitialised: fill them with load_weights (or init_random)."""

    def __init__(self, config: EncoderConfig, dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__()
        c = self.config = config
        kw = dict(dtype=dtype, device=device)
        D = c.hidden_size
        self.word_embeddings = nn.Embedding(c.vocab_size, D, _weight=torch.empty(c.vocab_size, D, **kw))
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, D,
                                                _weight=torch.empty(c.max_position_embeddings, D, **kw))
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, D,
                                                  _weight=torch.empty(c.type_vocab_size, D, **kw))
        self.embed_norm = LayerNorm(D, c.layer_norm_eps, **kw)
        self.layers = nn.ModuleList(EncoderLayer(c, i, dtype, device) for i in range(c.num_hidden_layers))

    @property
    def dtype(self) -> torch.dtype:
        return self.word_embeddings.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions (from 0 in each sequence), token_type_ids [T] -> hidden [T, D]."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.config.position_offset)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, attn)
        return x

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named backbone tensors (the model prefix already stripped: embeddings.*,
        encoder.layer.N.*); ValueError on unknown, misshapen or missing ones."""
        params = dict(self.named_parameters())
        D = self.config.hidden_size
        missing = {(name, start) for name in params
                   for start in ((0, D, 2 * D) if ".qkv_proj." in name else (None,))}
        for name, tensor in named_tensors:
            target, rows = self._destination(name)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for a {self.config.architecture} encoder")
            dst = params[target].data[rows]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor)
            missing.discard((target, rows.start))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} encoder weights, "
                             f"e.g. {sorted(n for n, _ in missing)[:5]}")

    def _destination(self, name: str) -> tuple[str, slice]:
        name = _legacy_norm_names(name)
        D = self.config.hidden_size
        if name.startswith("embeddings."):
            rest = name.removeprefix("embeddings.")
            return ("embed_norm." + rest.removeprefix("LayerNorm.")) if rest.startswith("LayerNorm.") else rest, slice(None)
        parts = name.split(".")     # encoder.layer.N.<path>
        if len(parts) < 5 or parts[:2] != ["encoder", "layer"]:
            return name, slice(None)
        layer, path = parts[2], ".".join(parts[3:])
        for i, part in enumerate(("query", "key", "value")):
            prefix = f"attention.self.{part}."
            if path.startswith(prefix):
                return f"layers.{layer}.qkv_proj.{path.removeprefix(prefix)}", slice(i * D, (i + 1) * D)
        mapped = _LAYER_NAMES.get(path.rsplit(".", 1)[0])
        if mapped is None:
            return name, slice(None)
        return f"layers.{layer}.{mapped}.{path.rsplit('.', 1)[1]}", slice(None)


_LAYER_NAMES = {"attention.output.dense": "o_proj", "attention.output.LayerNorm": "attn_norm",
                "intermediate.dense": "up_proj", "output.dense": "down_proj", "output.LayerNorm": "mlp_norm"}


def _legacy_norm_names(name: str) -> str:
    """Old (TF-converted) checkpoints call LayerNorm's weight and bias gamma and beta."""
    if name.endswith(".gamma"):
        return name[:-len("gamma")] + "weight"
    if name.endswith(".beta"):
        return name[:-len("beta")] + "bias"
    return name
