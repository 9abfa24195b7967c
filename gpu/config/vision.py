"""A vision-language checkpoint's plain-data description (issue 34), torch-free: what
render needs to turn a picture into pixel values and placeholder tokens (`VisionSpec`,
`ImageProcessing`, from preprocessor_config.json / processor_config.json), and what
gpu/models/llava_vision.py builds its vision tower from (config.json's vision_config).

Two layouts are served: llava-hf's (`LlavaForConditionalGeneration`: a CLIP or SigLIP
vision tower, the MLP projector, a Llama or Qwen2 decoder) and Qwen2.5-VL's
(`Qwen2_5_VLForConditionalGeneration`: dynamic resolution, a windowed vision tower, a
Qwen2 decoder with M-RoPE)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from gpu.formats.hf import read_json

VISION_ARCHITECTURES = ("llava", "qwen2_5_vl")
_VISION_CLASSES = {"LlavaForConditionalGeneration": "llava",
                   "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
VISION_TOWERS = ("clip_vision_model", "siglip_vision_model")
# each tower's config defaults (transformers' CLIPVisionConfig, SiglipVisionConfig)
_TOWER_DEFAULTS = {
    "clip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
                          "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
                            "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                            "layer_norm_eps": 1e-6}}
# PIL's resampling filters by the numbers HF configs store (PIL.Image.Resampling)
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


@attrs.frozen
class ImageProcessing:
    """A CLIP-style image processor's steps: resize (shortest edge, or to height x width),
    centre crop, rescale, normalise, as transformers' CLIPImageProcessor does them.
    SiglipImageProcessor's are the same less the crop: resize to height x width, rescale,
    normalise (its config has no do_center_crop, and it does none)."""
    do_convert_rgb: bool = True
    do_resize: bool = True
    shortest_edge: int | None = 224
    resize_to: tuple[int, int] | None = None     # (height, width) when size names both
    resample: int = 3                            # PIL's BICUBIC
    do_center_crop: bool = True
    crop_size: tuple[int, int] = (224, 224)      # (height, width)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ImageProcessing:
        size = d.get("size") or {"shortest_edge": 224}
        if isinstance(size, int):
            size = {"shortest_edge": size}
        siglip = str(d.get("image_processor_type", "")).startswith("Siglip")
        crop = d.get("crop_size") or size
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        crop_hw = ((crop["height"], crop["width"]) if "height" in crop
                   else (crop["shortest_edge"],) * 2)
        return cls(
            do_convert_rgb=bool(d.get("do_convert_rgb", True)),
            do_resize=bool(d.get("do_resize", True)),
            shortest_edge=size.get("shortest_edge"),
            resize_to=(size["height"], size["width"]) if "height" in size else None,
            resample=int(d.get("resample", 3)),
            do_center_crop=bool(d.get("do_center_crop", not siglip)),
            crop_size=tuple(crop_hw),
            do_rescale=bool(d.get("do_rescale", True)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            do_normalize=bool(d.get("do_normalize", True)),
            image_mean=tuple(d.get("image_mean") or cls.image_mean),
            image_std=tuple(d.get("image_std") or cls.image_std))

    @property
    def output_size(self) -> tuple[int, int] | None:
        """The pixel values' (height, width) whatever the picture, or None when it varies."""
        if self.do_center_crop:
            return self.crop_size
        if self.do_resize and self.resize_to is not None:
            return self.resize_to
        return None


@attrs.frozen
class QwenImageProcessing:
    """Qwen2-VL's image processor (transformers' Qwen2VLImageProcessor): resize to a
    multiple of patch_size x merge_size with the pixel count within [min_pixels,
    max_pixels] (smart_resize), rescale, normalise, the picture repeated
    temporal_patch_size times and cut into flattened patches [patches, C*T*P*P] in the
    merge blocks' order."""
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    do_convert_rgb: bool = True
    do_resize: bool = True
    resample: int = 3
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

    # the options a request may set (vLLM's mm_processor_kwargs)
    REQUEST_OPTIONS = ("min_pixels", "max_pixels")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> QwenImageProcessing:
        size = d.get("size") or {}
        min_pixels = d.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
        max_pixels = d.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        return cls(
            patch_size=int(d.get("patch_size", 14)), merge_size=int(d.get("merge_size", 2)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            min_pixels=int(min_pixels or cls.min_pixels),
            max_pixels=int(max_pixels or cls.max_pixels),
            do_convert_rgb=bool(d.get("do_convert_rgb", True)),
            do_resize=bool(d.get("do_resize", True)), resample=int(d.get("resample", 3)),
            do_rescale=bool(d.get("do_rescale", True)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            do_normalize=bool(d.get("do_normalize", True)),
            image_mean=tuple(d.get("image_mean") or cls.image_mean),
            image_std=tuple(d.get("image_std") or cls.image_std))

    def with_options(self, options: dict[str, Any]) -> QwenImageProcessing:
        """A request's mm_processor_kwargs applied; ValueError (a 400) on an unknown or
        out-of-range option."""
        changes = {}
        for key, value in options.items():
            if key not in self.REQUEST_OPTIONS:
                raise ValueError(f"unknown option {key!r}; this model's processor takes "
                                 f"{', '.join(self.REQUEST_OPTIONS)}")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key!r} must be a positive integer")
            changes[key] = value
        out = attrs.evolve(self, **changes)
        factor = out.patch_size * out.merge_size
        if out.min_pixels > out.max_pixels:
            raise ValueError(f"min_pixels ({out.min_pixels}) is more than max_pixels "
                             f"({out.max_pixels})")
        if out.max_pixels < factor * factor:
            raise ValueError(f"max_pixels must be at least {factor * factor} "
                             f"({factor}x{factor}, one merged patch)")
        return out


@attrs.frozen
class VisionSpec:
    """What render needs of a vision-language model: its image placeholder token and how
    many of them a picture takes (fixed for LLaVA; 0 for Qwen2.5-VL, whose count follows
    the picture's size), and its image processor."""
    architecture: str
    image_token: str
    image_token_id: int
    tokens_per_image: int
    processing: ImageProcessing | QwenImageProcessing

    @property
    def modalities(self) -> tuple[str, ...]:
        return ("image",)


def vision_architecture(d: dict[str, Any]) -> str | None:
    if d.get("model_type") in VISION_ARCHITECTURES:
        return d["model_type"]
    return next((_VISION_CLASSES[a] for a in d.get("architectures") or ()
                 if a in _VISION_CLASSES), None)


def is_vision_config(d: dict[str, Any]) -> bool:
    return vision_architecture(d) is not None


def text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config.json part of a vision-language config (llava: text_config;
    Qwen2.5-VL: text_config in transformers 5, the top level in 4), with the top level's
    ids where the text part lacks them."""
    if vision_architecture(d) == "qwen2_5_vl":
        text = dict(d.get("text_config") or {k: v for k, v in d.items()
                                             if k not in ("vision_config", "architectures")})
        text["model_type"] = "qwen2"     # a Qwen2 decoder; its mrope_section read by ModelConfig
    else:
        text = dict(d.get("text_config") or {})
    text.setdefault("model_type", "llama")
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in d and key not in text:
            text[key] = d[key]
    return text


def vision_tower_config(d: dict[str, Any]) -> dict[str, Any]:
    """config.json's vision_config with its tower's defaults (CLIP's or SigLIP's) filled in."""
    given = d.get("vision_config") or {}
    kind = given.get("model_type", "clip_vision_model")
    if kind not in VISION_TOWERS:
        raise ValueError(f"unsupported vision tower {kind!r}; supported: "
                         f"{', '.join(VISION_TOWERS)}")
    v = {**_TOWER_DEFAULTS[kind], **given, "model_type": kind}
    for key in ("image_size", "patch_size"):
        if not isinstance(v[key], int):
            raise ValueError(f"unsupported vision tower {key} {v[key]!r}: a single integer "
                             "(square pictures and patches) is served")
    return v


def feature_layers(d: dict[str, Any]) -> tuple[int, ...]:
    layer = d.get("vision_feature_layer", -2)
    return tuple(layer) if isinstance(layer, (list, tuple)) else (int(layer),)


def qwen_vision_config(d: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2.5-VL config.json's vision_config with transformers' defaults filled in."""
    v = {"depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420,
         "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
         "temporal_patch_size": 2, "window_size": 112, "out_hidden_size": 3584,
         "fullatt_block_indexes": [7, 15, 23, 31], **(d.get("vision_config") or {})}
    v["rope_theta"] = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return v


def qwen_vision_spec(model_dir: Path, config: dict[str, Any], tokenizer=None) -> VisionSpec:
    """A Qwen2.5-VL folder's VisionSpec: Qwen2-VL's image processor from
    preprocessor_config.json; <|image_pad|> the placeholder, as many as the picture's
    merged patches."""
    proc = read_json(model_dir / "processor_config.json")
    pre = read_json(model_dir / "preprocessor_config.json") or proc.get("image_processor") or {}
    processing = QwenImageProcessing.from_hf(pre)
    v = qwen_vision_config(config)
    if (processing.patch_size, processing.merge_size, processing.temporal_patch_size) != (
            v["patch_size"], v["spatial_merge_size"], v["temporal_patch_size"]):
        raise ValueError(f"{model_dir}: the image processor's patch_size/merge_size/"
                         "temporal_patch_size differ from the vision tower's")
    token = "<|image_pad|>"
    token_id = config.get("image_token_id")
    if tokenizer is not None and tokenizer.hf.token_to_id(token) is not None:
        token_id = tokenizer.hf.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{model_dir}: config.json has no image_token_id")
    return VisionSpec("qwen2_5_vl", token, int(token_id), 0, processing)


def vision_spec(model_dir: Path, config: dict[str, Any], tokenizer=None) -> VisionSpec:
    if vision_architecture(config) == "qwen2_5_vl":
        return qwen_vision_spec(model_dir, config, tokenizer)
    return llava_vision_spec(model_dir, config, tokenizer)


def llava_vision_spec(model_dir: Path, config: dict[str, Any], tokenizer=None) -> VisionSpec:
    """The VisionSpec of a llava-hf folder: the image processor from
    preprocessor_config.json (else processor_config.json's image_processor), the
    placeholder count from the tower's patches and the feature select strategy."""
    proc = read_json(model_dir / "processor_config.json")
    pre = read_json(model_dir / "preprocessor_config.json") or proc.get("image_processor") or {}
    processing = ImageProcessing.from_hf(pre)
    v = vision_tower_config(config)
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}")
    side = v["image_size"] // v["patch_size"]
    # CLIP's features carry a class token first, SigLIP's none; "default" drops the first
    # feature, "full" keeps them all (transformers' LlavaModel.get_image_features)
    tokens = side * side + (1 if v["model_type"] == "clip_vision_model" else 0) - (
        1 if strategy == "default" else 0)
    token = proc.get("image_token") or "<image>"
    token_id = config.get("image_token_index", config.get("image_token_id"))
    if tokenizer is not None and tokenizer.hf.token_to_id(token) is not None:
        token_id = tokenizer.hf.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{model_dir}: config.json has no image_token_index")
    size = processing.output_size
    if size is not None and size != (v["image_size"],) * 2:
        raise ValueError(f"{model_dir}: the image processor makes {size[0]}x{size[1]} pictures, "
                         f"the vision tower takes {v['image_size']}x{v['image_size']}")
    return VisionSpec("llava", token, int(token_id), tokens, processing)
