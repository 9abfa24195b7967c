"""The vision side of a llava-hf LLaVA (issue 34): a CLIP or SigLIP vision tower and the MLP
projector that maps its patch features into the decoder's embedding space. The decoder
is gpu/models/causal_lm.py's CausalLM; the runner (gpu/worker/runner.py) puts each picture's features in
place of its placeholder tokens' embeddings before the prefill chunk that holds them.

The tower's attention is bidirectional over one picture's patches: torch's SDPA (a fused
kernel on CUDA), no KV cache."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gpu.config.vision import feature_layers, vision_tower_config

_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
         "relu": F.relu}


def _act(name: str):
    if name not in _ACTS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTS)}")
    return _ACTS[name]


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dtype, device):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, dtype=dtype, device=device)
        self.k_proj = nn.Linear(dim, dim, dtype=dtype, device=device)
        self.v_proj = nn.Linear(dim, dim, dtype=dtype, device=device)
        self.out_proj = nn.Linear(dim, dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # [N, P, D]
        n, p, d = x.shape
        q, k, v = (f(x).view(n, p, self.heads, d // self.heads).transpose(1, 2)
                   for f in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)        # non-causal, [N, H, P, hd]
        return self.out_proj(out.transpose(1, 2).reshape(n, p, d))


class _Layer(nn.Module):
    def __init__(self, v: dict, dtype, device):
        super().__init__()
        dim, eps = v["hidden_size"], v["layer_norm_eps"]
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps, dtype=dtype, device=device)
        self.self_attn = _Attention(dim, v["num_attention_heads"], dtype, device)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps, dtype=dtype, device=device)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, v["intermediate_size"], dtype=dtype, device=device)
        self.mlp.fc2 = nn.Linear(v["intermediate_size"], dim, dtype=dtype, device=device)
        self.act = _act(v["hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer: patch embedding (a strided conv), a class token, learned
    positions, pre-norm, encoder layers. Returns the hidden states after the layers asked for."""
    UNUSED: tuple[str, ...] = ()   # checkpoint tensors LLaVA never reads (SigLIP's head)

    def __init__(self, v: dict, dtype, device):
        super().__init__()
        dim, patch = v["hidden_size"], v["patch_size"]
        self.num_patches = (v["image_size"] // patch) ** 2
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.embeddings.patch_embedding = nn.Conv2d(v["num_channels"], dim, patch, stride=patch,
                                                    bias=False, dtype=dtype, device=device)
        self.embeddings.position_embedding = nn.Embedding(self.num_patches + 1, dim, dtype=dtype,
                                                          device=device)
        self.pre_layrnorm = nn.LayerNorm(dim, eps=v["layer_norm_eps"], dtype=dtype, device=device)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_Layer(v, dtype, device)
                                            for _ in range(v["num_hidden_layers"]))
        # post_layernorm is in the checkpoint; LLaVA reads a layer's hidden states before it
        self.post_layernorm = nn.LayerNorm(dim, eps=v["layer_norm_eps"], dtype=dtype, device=device)

    def forward(self, pixels: torch.Tensor, layers: tuple[int, ...]) -> list[torch.Tensor]:
        """pixels [N, 3, H, W] -> the hidden states [N, 1 + P, D] of each of `layers`, in
        HF's numbering (0: the embeddings, k: after layer k; negative from the end)."""
        e = self.embeddings
        x = e.patch_embedding(pixels.to(e.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = e.class_embedding.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + e.position_embedding.weight[None]
        x = self.pre_layrnorm(x)
        return _hidden_states(self.encoder.layers, x, layers)


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer: patch embedding (a strided conv, with a bias), learned
    positions, no class token and no pre-norm, pre-LN encoder layers. post_layernorm and
    the attention-pooling head are in the checkpoint; LLaVA reads a layer's hidden states
    before both (transformers' hidden_states), so neither is run, and the head is not kept."""

    def __init__(self, v: dict, dtype, device):
        super().__init__()
        dim, patch = v["hidden_size"], v["patch_size"]
        self.num_patches = (v["image_size"] // patch) ** 2
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(v["num_channels"], dim, patch, stride=patch,
                                                    dtype=dtype, device=device)
        self.embeddings.position_embedding = nn.Embedding(self.num_patches, dim, dtype=dtype,
                                                          device=device)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_Layer(v, dtype, device)
                                            for _ in range(v["num_hidden_layers"]))
        self.post_layernorm = nn.LayerNorm(dim, eps=v["layer_norm_eps"], dtype=dtype, device=device)

    # the checkpoint's tensors this tower does not use (vision_use_head's pooling head)
    UNUSED = ("vision_tower.head.",)

    def forward(self, pixels: torch.Tensor, layers: tuple[int, ...]) -> list[torch.Tensor]:
        """pixels [N, 3, H, W] -> the hidden states [N, P, D] of each of `layers`, in HF's
        numbering (0: the embeddings, k: after layer k; negative from the end)."""
        e = self.embeddings
        x = e.patch_embedding(pixels.to(e.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = x + e.position_embedding.weight[None]
        return _hidden_states(self.encoder.layers, x, layers)


_TOWERS = {"clip_vision_model": ClipVisionTower, "siglip_vision_model": SiglipVisionTower}


class LlavaVision(nn.Module):
    """The tower and the projector: pictures -> [N, tokens_per_image, text hidden size]."""

    variable_size = False   # pictures of one size, encoded in batches (the runner's _encode)

    def __init__(self, config: dict, text_hidden: int, dtype=torch.float32, device="cpu"):
        super().__init__()
        v = vision_tower_config(config)
        self.layers = feature_layers(config)
        self.strategy = config.get("vision_feature_select_strategy", "default")
        self.vision_tower = _TOWERS[v["model_type"]](v, dtype, device)
        bias = bool(config.get("multimodal_projector_bias", True))
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear_1 = nn.Linear(v["hidden_size"] * len(self.layers),
                                                        text_hidden, bias=bias, dtype=dtype,
                                                        device=device)
        self.multi_modal_projector.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias,
                                                        dtype=dtype, device=device)
        self.act = _act(config.get("projector_hidden_act", "gelu"))

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        feats = torch.cat(self.vision_tower(pixels, self.layers), dim=-1)
        if self.strategy == "default":
            feats = feats[:, 1:]        # drop CLIP's class token (SigLIP's first patch)
        p = self.multi_modal_projector
        return p.linear_2(self.act(p.linear_1(feats)))

    @staticmethod
    def split_checkpoint(named, vision: list):
        return split_checkpoint(named, vision)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Our names (vision_tower.*, multi_modal_projector.*); raises on unknown, misshapen
        or missing weights."""
        load_vision_weights(self, named, unused=self.vision_tower.UNUSED)


def load_vision_weights(module: nn.Module, named: Iterable[tuple[str, torch.Tensor]], *,
                        unused: tuple[str, ...] = ()) -> None:
    """Copy a vision side's tensors into `module`'s parameters by name; raises on unknown,
    misshapen or missing weights (tensors under an `unused` prefix that the module does not
    have are skipped)."""
    params = dict(module.named_parameters())
    missing = set(params)
    for name, tensor in named:
        if unused and name.startswith(unused) and name not in params:
            continue
        if name not in params:
            raise ValueError(f"unexpected vision weight {name!r}")
        dst = params[name]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        missing.discard(name)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} vision weights, e.g. "
                         f"{sorted(missing)[:5]}")


def _hidden_states(encoder_layers, x: torch.Tensor, layers) -> list[torch.Tensor]:
    """The hidden states at `layers` (0: the embeddings x, k: after layer k; negative from
    the end), running the layers only as far as the deepest one asked."""
    total = len(encoder_layers) + 1
    wanted = sorted({k % total for k in layers})
    states = {0: x}
    for i, layer in enumerate(encoder_layers[:wanted[-1]], start=1):
        x = layer(x)
        states[i] = x
    return [states[k % total] for k in layers]


def split_checkpoint(named: Iterable[tuple[str, torch.Tensor]], vision: list):
    """A llava-hf checkpoint's tensors, by the names of transformers 4 (language_model.model.*,
    vision_tower.vision_model.*) or 5 (model.language_model.*, model.vision_tower.*): the
    decoder's yielded as CausalLM names them (model.*, lm_head.weight), the vision side's
    appended to `vision` as LlavaVision names them."""
    for name, t in named:
        if name.startswith("model.") and name.split(".")[1] in (
                "vision_tower", "multi_modal_projector", "language_model"):
            name = name[len("model."):]
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            vision.append((name.replace("vision_tower.vision_model.", "vision_tower."), t))
            continue
        if name.startswith("language_model."):
            name = name[len("language_model."):]
            if not name.startswith(("model.", "lm_head.")):
                name = "model." + name
        yield name, t
