"""What a pooling model does, as plain data (no torch): the runner it needs, its pooler's
settings and where they come from.

A checkpoint is served by the pooling runner (vLLM's `--runner pooling`) when it is an
encoder (BERT, RoBERTa: `model_type` or an `architectures` entry), a sequence
classifier (`...ForSequenceClassification`), or a sentence-transformers folder
(`modules.json`); `--convert embed|classify` turns a decoder into one. The pooler's
settings are, in order of precedence: `--pooler-config` (a JSON object, vLLM's keys),
the checkpoint's sentence-transformers modules (`1_Pooling/config.json`, a
`Normalize` module), and the architecture's default (embedding: encoders CLS, decoders
LAST, normalized; classification: CLS for encoders, LAST for decoders, with the
activation on).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from gpu.formats.hf import read_json
from gpu.config.overrides import apply_hf_overrides

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("MEAN", "CLS", "LAST")
TASKS = ("embed", "classify")
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
_ENCODER_CLASSES = {"BertModel": "bert", "BertForSequenceClassification": "bert",
                    "RobertaModel": "roberta", "RobertaForSequenceClassification": "roberta",
                    "XLMRobertaModel": "xlm-roberta",
                    "XLMRobertaForSequenceClassification": "xlm-roberta"}
# sentence-transformers' 1_Pooling/config.json modes -> our pooling types
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")
_ST_MODULE = "sentence_transformers.models."
_ST_KNOWN = ("Transformer", "Pooling", "Normalize")


class PoolingConfigError(ValueError):
    """A pooler setting that cannot be used (a flag's value, or a checkpoint's module)."""


@attrs.frozen
class PoolerConfig:
    """vLLM's `--pooler-config` keys; None: not set here (the next source decides)."""
    pooling_type: str | None = attrs.field(default=None)
    normalize: bool | None = None
    dimensions: int | None = None       # Matryoshka models only: the default output size
    use_activation: bool | None = None  # classification: sigmoid (1 label) or softmax

    @pooling_type.validator
    def _check_type(self, _, value):
        if value is not None and value not in POOLING_TYPES:
            raise PoolingConfigError(f"pooling_type {value!r} is not supported; choose from "
                                     f"{', '.join(POOLING_TYPES)}")

    def over(self, other: PoolerConfig) -> PoolerConfig:
        """These settings, with other's where these are unset."""
        theirs = attrs.asdict(other)
        return PoolerConfig(**{k: theirs[k] if v is None else v for k, v in attrs.asdict(self).items()})


def parse_pooler_config(text: str | None) -> PoolerConfig:
    """`--pooler-config '{"pooling_type": "MEAN", "normalize": false}'`; errors name the key."""
    if not text:
        return PoolerConfig()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise PoolingConfigError(f"--pooler-config is not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise PoolingConfigError("--pooler-config must be a JSON object")
    known = {f.name for f in attrs.fields(PoolerConfig)}
    for key, value in raw.items():
        if key not in known:
            raise PoolingConfigError(f"--pooler-config: unknown key {key!r}; supported: {', '.join(sorted(known))}")
        if key in ("normalize", "use_activation") and not isinstance(value, bool | None):
            raise PoolingConfigError(f"--pooler-config: {key} must be true or false")
        if key == "dimensions" and value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise PoolingConfigError("--pooler-config: dimensions must be a positive integer")
    if isinstance(raw.get("pooling_type"), str):
        raw["pooling_type"] = raw["pooling_type"].upper()
    return PoolerConfig(**raw)


def encoder_type(config: dict[str, Any]) -> str | None:
    """'bert' / 'roberta' / 'xlm-roberta' for an encoder's config.json, else None."""
    if config.get("model_type") in ENCODER_TYPES:
        return config["model_type"]
    return next((_ENCODER_CLASSES[a] for a in config.get("architectures") or () if a in _ENCODER_CLASSES), None)


def is_classifier(config: dict[str, Any]) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ())


def detect_runner(path: str | Path | None, hf_overrides: dict | None = None) -> str:
    """'pooling' for an encoder, a sequence classifier or a sentence-transformers folder
    (config.json with --hf-overrides over it); else 'generate' (a GGUF file, a decoder's
    folder)."""
    if path is None:
        return "generate"
    p = Path(path).expanduser()
    if p.is_file():
        p = p.parent if p.name.endswith(".json") else p
    if not p.is_dir():
        return "generate"
    config = apply_hf_overrides(read_json(p / "config.json"), hf_overrides)
    if encoder_type(config) or is_classifier(config) or (p / "modules.json").is_file():
        return "pooling"
    return "generate"


def resolve_task(config: dict[str, Any], convert: str) -> str:
    """'embed' or 'classify': --convert when given, else a classifier's head, else embed."""
    if convert not in CONVERTS:
        raise PoolingConfigError(f"--convert {convert!r}: choose from {', '.join(CONVERTS)}")
    if convert in ("embed", "classify"):
        return convert
    return "classify" if is_classifier(config) else "embed"


def checkpoint_pooler(model_dir: Path) -> PoolerConfig:
    """The pooler a sentence-transformers folder describes (modules.json, its Pooling module's
    config.json, a Normalize module); PoolerConfig() when the folder has no modules.json."""
    modules = model_dir / "modules.json"
    if not modules.is_file():
        return PoolerConfig()
    entries = json.loads(modules.read_text())
    kinds = [str(m.get("type", "")).removeprefix(_ST_MODULE) for m in entries]
    unknown = [k for k in kinds if k not in _ST_KNOWN]
    if unknown:
        raise PoolingConfigError(f"{modules}: sentence-transformers module {unknown[0]!r} is not "
                                 f"supported (only {', '.join(_ST_KNOWN)})")
    pooling_type = None
    for entry, kind in zip(entries, kinds):
        if kind != "Pooling":
            continue
        cfg = read_json(model_dir / entry.get("path", "") / "config.json")
        bad = [k for k in _ST_UNSUPPORTED if cfg.get(k)]
        if bad:
            raise PoolingConfigError(f"{model_dir}: pooling mode {bad[0]} is not supported")
        modes = [t for k, t in _ST_MODES.items() if cfg.get(k)]
        if len(modes) > 1:
            raise PoolingConfigError(f"{model_dir}: several pooling modes at once ({', '.join(modes)})")
        pooling_type = modes[0] if modes else None
    return PoolerConfig(pooling_type=pooling_type, normalize="Normalize" in kinds)


def default_pooler(task: str, encoder: bool) -> PoolerConfig:
    """The architecture's default (vLLM's): an embedding is normalized; encoders pool the CLS
    token, decoders the last token; a classifier applies its activation."""
    return PoolerConfig(pooling_type="CLS" if encoder else "LAST",
                        normalize=task == "embed", use_activation=True)


def sentence_max_length(model_dir: Path) -> int | None:
    """sentence-transformers' max_seq_length (sentence_bert_config.json): the longest input the
    model was trained to take, which vLLM also takes as the model's length."""
    value = read_json(model_dir / "sentence_bert_config.json").get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None


def matryoshka_dimensions(config: dict[str, Any]) -> tuple[int, ...] | None:
    """The output sizes a Matryoshka model was trained for (config.json `matryoshka_dimensions`,
    or `is_matryoshka`: any size); None: not Matryoshka (a `dimensions` request is refused)."""
    dims = config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return () if config.get("is_matryoshka") else None


@attrs.frozen
class PoolingSpec:
    """A loaded pooling model's behaviour, what render, the API and the runner read."""
    task: str                       # embed | classify
    pooling_type: str               # MEAN | CLS | LAST
    normalize: bool                 # embed: L2-normalize (after any Matryoshka cut)
    use_activation: bool            # classify: sigmoid for one label, softmax for several
    hidden_size: int                # an embedding's size
    num_labels: int = 0             # classify: the head's outputs
    labels: tuple[str, ...] = ()    # classify: id2label in order
    dimensions: int | None = None   # the default output size (Matryoshka)
    matryoshka: tuple[int, ...] | None = None   # None: not Matryoshka; (): any size
    encoder: bool = False           # bidirectional (an encoder) or causal (a decoder)
    sep_token_id: int | None = None   # a cross-encoder's pair: token type 1 after the first SEP

    @property
    def output_size(self) -> int:
        return self.num_labels if self.task == "classify" else (self.dimensions or self.hidden_size)


def pooling_spec(config: dict[str, Any], model_dir: Path | None, *, convert: str = "auto",
                 flag: PoolerConfig = PoolerConfig()) -> PoolingSpec:
    """The spec from config.json, the folder's sentence-transformers files and the flags."""
    task = resolve_task(config, convert)
    encoder = encoder_type(config) is not None
    checkpoint = checkpoint_pooler(model_dir) if model_dir is not None else PoolerConfig()
    chosen = flag.over(checkpoint).over(default_pooler(task, encoder))
    matryoshka = matryoshka_dimensions(config)
    hidden = int(config["hidden_size"])
    labels: tuple[str, ...] = ()
    num_labels = 0
    if task == "classify":
        id2label = config.get("id2label") or {}
        # transformers leaves id2label out of config.json at its default, two labels
        num_labels = int(config.get("num_labels") or len(id2label) or 2)
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
    if chosen.dimensions is not None:
        check_dimensions(chosen.dimensions, hidden, matryoshka, "--pooler-config dimensions")
    return PoolingSpec(task=task, pooling_type=chosen.pooling_type, normalize=bool(chosen.normalize),
                       use_activation=bool(chosen.use_activation), hidden_size=hidden,
                       num_labels=num_labels, labels=labels, dimensions=chosen.dimensions,
                       matryoshka=matryoshka, encoder=encoder)


def check_dimensions(dimensions: int, hidden: int, matryoshka: tuple[int, ...] | None, name: str) -> None:
    """vLLM's rule: only a Matryoshka model changes its output size, to one it was trained for."""
    if matryoshka is None:
        raise PoolingConfigError(f"{name}: this model does not support Matryoshka representation; "
                                 "changing its output dimensions would give poor results")
    if not 1 <= dimensions <= hidden:
        raise PoolingConfigError(f"{name} must be between 1 and {hidden}, got {dimensions}")
    if matryoshka and dimensions not in matryoshka:
        raise PoolingConfigError(f"{name} {dimensions} is not one of the model's Matryoshka "
                                 f"dimensions {list(matryoshka)}")
