"""load_pooling_model: a Hugging Face folder -> LoadedPooling (issue 32).

An encoder's folder (BertModel, BertForSequenceClassification, RoBERTa/XLM-R, a
sentence-transformers folder), or a decoder's with `convert` embed|classify (SmolLM2,
Qwen3-Embedding: the decoder without its LM head, pooling the last token; a
`...ForSequenceClassification` with its `score` head). Weights from safetensors, or
`load_format="dummy"` (deterministic random weights, for tests and benchmarks).
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import attrs
import torch

from gpu.formats import hf as weights_hf
from gpu.config.overrides import apply_hf_overrides
from gpu.config.model import ModelConfig
from gpu.models.bert import Encoder, EncoderConfig
from gpu.loader.decoder import open_source, resolve_dtype
from gpu.models.causal_lm import CausalLM
from gpu.models.registry import model_class
from gpu.layers.pooler import ClassifierHead, PoolingModel
from gpu.config.pooling import PoolerConfig, PoolingSpec, encoder_type, pooling_spec, sentence_max_length
from gpu.tokenizers.tokenizer import Tokenizer, tokenizer_from_hf_dir
from gpu.tokenizers.files import default_model_path

# checkpoint tensors a pooling model never reads: BERT's MLM/NSP heads, position id buffers
_SKIPPED = ("cls.", "lm_head.", "embeddings.position_ids", "rotary_emb.inv_freq")
_MODEL_PREFIXES = ("bert.", "roberta.", "model.")


@attrs.frozen
class LoadedPooling:
    spec: PoolingSpec
    model: PoolingModel
    tokenizer: Tokenizer | None
    name: str
    path: str
    max_model_len: int
    config: EncoderConfig | ModelConfig
    head_dim: int
    num_heads: int


def load_pooling_model(model: str | Path | None, *, convert: str = "auto",
                       pooler_config: PoolerConfig = PoolerConfig(), load_format: str = "auto",
                       dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                       seed: int = 0, hf_overrides: dict | None = None) -> LoadedPooling:
    """model: a HF folder (an encoder, a classifier, a decoder), or a decoder's GGUF file
    (None: the bundled SmolLM2) with convert embed|classify. hf_overrides (--hf-overrides):
    laid over config.json (a GGUF's config) before the encoder, the family and the pooling
    spec read it: a Matryoshka declaration, for one."""
    path = Path(model).expanduser() if model is not None else default_model_path()
    if path.is_file() and path.name.endswith(".json"):
        path = path.parent
    if load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ValueError(f"unsupported load_format {load_format!r} for a pooling model")
    folder = path if (path / "config.json").is_file() else None
    raw = (apply_hf_overrides(weights_hf.read_json(path / "config.json"), hf_overrides)
           if folder is not None else None)
    torch_dtype = resolve_dtype(dtype, device)
    if raw is not None and encoder_type(raw) is not None:
        spec = pooling_spec(raw, folder, convert=convert, flag=pooler_config)
        config = EncoderConfig.from_hf(raw)
        backbone = Encoder(config, torch_dtype, device)
        tokenizer = tokenizer_from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
        kind = "bert" if config.architecture == "bert" else "roberta"
        max_len, heads = config.max_positions, (config.head_dim, config.num_attention_heads)
        weights = (lambda: weights_hf.named_tensors(weights_hf.safetensors_files(path)))
    else:   # a decoder (GGUF or safetensors), converted
        source = open_source(path, "dummy" if load_format == "dummy" else load_format, hf_overrides)
        config = source.config
        if config.num_experts or config.attention_sinks or config.layer_types:
            raise ValueError(f"{config.architecture} cannot be served as a pooling model")
        if raw is None:   # a GGUF file: its config, with the overrides
            raw = apply_hf_overrides({"hidden_size": config.hidden_size}, hf_overrides)
        spec = pooling_spec(raw, folder, convert=convert, flag=pooler_config)
        backbone = model_class(config)(config, torch_dtype, device, lm_head=False)
        tokenizer, kind = source.tokenizer, "decoder"
        max_len, heads = config.max_position_embeddings, (config.head_dim, config.num_attention_heads)
        weights = source.named_tensors
    head = (ClassifierHead(kind, spec.hidden_size, spec.num_labels, torch_dtype, device)
            if spec.task == "classify" else None)
    sep = None
    if tokenizer is not None and spec.encoder:
        sep = tokenizer.hf.token_to_id("[SEP]" if kind == "bert" else "</s>")
    spec = attrs.evolve(spec, sep_token_id=sep)
    pooling = PoolingModel(backbone, spec, head)
    if load_format == "dummy":
        init_random(pooling, seed)
    else:
        load_weights(pooling, weights())
    pooling.eval()
    st_len = sentence_max_length(folder) if folder is not None else None
    return LoadedPooling(spec=spec, model=pooling, tokenizer=tokenizer, name=path.resolve().name, path=str(path),
                         max_model_len=min(max_len, st_len or max_len), config=config,
                         head_dim=heads[0], num_heads=heads[1])


def load_weights(model: PoolingModel, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Route each checkpoint tensor to the backbone or the head; ValueError on what fits neither."""
    head_names = model.head.checkpoint_names() if model.head is not None else {}
    head_params = dict(model.head.named_parameters()) if model.head is not None else {}
    head_missing = set(head_names.values())
    encoder = model.spec.encoder

    def backbone_tensors():
        for name, tensor in named_tensors:
            bare = name
            if encoder:   # BertForSequenceClassification's bert., RoBERTa's roberta.
                bare = next((name.removeprefix(p) for p in _MODEL_PREFIXES if name.startswith(p)), name)
            if name in head_names or bare in head_names:
                target = head_names.get(name) or head_names[bare]
                dst = head_params[target]
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                with torch.no_grad():
                    dst.copy_(tensor)
                head_missing.discard(target)
            elif bare.startswith(_SKIPPED) or name.startswith(_SKIPPED) or (encoder and bare.startswith("pooler.")):
                continue
            else:
                yield bare, tensor

    model.backbone.load_weights(backbone_tensors())
    if head_missing:
        raise ValueError(f"checkpoint is missing the classifier head's {sorted(head_missing)}")


@torch.no_grad()
def init_random(model: PoolingModel, seed: int) -> None:
    """Deterministic random weights: N(0, 0.02) matrices and embeddings, zero biases, unit norms."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=gen))

