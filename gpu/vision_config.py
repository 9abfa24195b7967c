"""A vision-language checkpoint's plain-data description (issue 34), torch-free: what
render needs to turn a picture into pixel values and placeholder tokens (`VisionSpec`,
`ImageProcessing`, from preprocessor_config.json / processor_config.json), and what
gpu/vision.py builds its vision tower from (config.json's vision_config).

Only the llava-hf layout (`LlavaForConditionalGeneration`: a CLIP vision tower, the MLP
projector, a Llama or Qwen2 decoder) is served."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from gpu.weights_hf import read_json

VISION_ARCHITECTURES = ("llava",)
VISION_TOWERS = ("clip_vision_model",)
# PIL's resampling filters by the numbers HF configs store (PIL.Image.Resampling)
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


@attrs.frozen
class ImageProcessing:
    """A CLIP-style image processor's steps: resize (shortest edge, or to height x width),
    centre crop, rescale, normalise, as transformers' CLIPImageProcessor does them."""
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
            do_center_crop=bool(d.get("do_center_crop", True)),
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
class VisionSpec:
    """What render needs of a vision-language model: its image placeholder token and how
    many of them a picture takes, and its image processor."""
    architecture: str
    image_token: str
    image_token_id: int
    tokens_per_image: int
    processing: ImageProcessing

    @property
    def modalities(self) -> tuple[str, ...]:
        return ("image",)


def is_vision_config(d: dict[str, Any]) -> bool:
    return d.get("model_type") in VISION_ARCHITECTURES or any(
        a == "LlavaForConditionalGeneration" for a in d.get("architectures") or ())


def text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config.json part of a vision-language config (llava: text_config),
    with the top level's ids where the text part lacks them."""
    text = dict(d.get("text_config") or {})
    text.setdefault("model_type", "llama")
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in d and key not in text:
            text[key] = d[key]
    return text


def vision_tower_config(d: dict[str, Any]) -> dict[str, Any]:
    """config.json's vision_config with CLIP's defaults filled in."""
    v = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
         "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
         "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "model_type": "clip_vision_model",
         **(d.get("vision_config") or {})}
    if v["model_type"] not in VISION_TOWERS:
        raise ValueError(f"unsupported vision tower {v['model_type']!r}; supported: "
                         f"{', '.join(VISION_TOWERS)}")
    return v


def feature_layers(d: dict[str, Any]) -> tuple[int, ...]:
    layer = d.get("vision_feature_layer", -2)
    return tuple(layer) if isinstance(layer, (list, tuple)) else (int(layer),)


def vision_spec(model_dir: Path, config: dict[str, Any], tokenizer=None) -> VisionSpec:
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
    tokens = side * side + (1 if strategy == "full" else 0)
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
