"""Tiny random-weight vision-language checkpoints made with transformers (issue 34): a
llava-hf LLaVA (CLIP or SigLIP vision tower, MLP projector, Llama decoder) saved as a HF folder
with its processor (preprocessor_config.json, processor_config.json), tokenizer (SmolLM2's
with an added <image> token) and chat template."""
from __future__ import annotations

from pathlib import Path

# A chat template that takes content as a string or as parts ({"type": "image"} / text),
# as llava-hf templates do.
LLAVA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

IMAGE_SIZE = 30     # the CLIP tower's input (crop) size
PATCH = 6           # 5 x 5 patches: 25 image tokens a picture
SIGLIP_SIZE = 28    # the SigLIP tower's input size (resized to, no crop)
SIGLIP_PATCH = 7    # 4 x 4 patches: 16 image tokens a picture


def make_llava(out_dir: Path, seed: int = 0, tower: str = "clip"):
    """Save the tiny LLaVA to out_dir; returns (model, processor). tower "siglip": a
    2-layer SigLIP tower (28 px, 7 px patches: 16 image tokens, none dropped) read at its
    last layer, with SiglipImageProcessor, as llava-interleave's layout."""
    import torch
    import transformers
    from tokenizers import AddedToken

    from gpu.tokenizers.files import load_tokenizer

    hf = load_tokenizer(None).hf
    hf.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    image_id = hf.token_to_id("<image>")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=hf, bos_token="<|im_start|>",
                                               eos_token="<|im_end|>", pad_token="<|im_end|>")
    text = transformers.LlamaConfig(
        vocab_size=image_id + 1, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, eos_token_id=hf.token_to_id("<|im_end|>"),
        bos_token_id=hf.token_to_id("<|im_start|>"))
    if tower == "siglip":
        vision = transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=SIGLIP_SIZE, patch_size=SIGLIP_PATCH)
        strategy, layer, extra = "full", -1, 0
    else:
        vision = transformers.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
        strategy, layer, extra = "default", -2, 1
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=image_id, projector_hidden_act="gelu",
                                      vision_feature_select_strategy=strategy,
                                      vision_feature_layer=layer)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():   # norms and biases away from their 1/0 init, so loading them wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
            elif p.dim() >= 2:
                p.mul_(3.0)     # large enough weights that the picture changes the answer
    if tower == "siglip":
        from transformers.models.siglip.image_processing_pil_siglip import (
            SiglipImageProcessorPil)
        images = SiglipImageProcessorPil(size={"height": SIGLIP_SIZE, "width": SIGLIP_SIZE})
    else:
        images = transformers.CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.LlavaProcessor(
        image_processor=images, tokenizer=tok, patch_size=vision.patch_size,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=extra,
        image_token="<image>", chat_template=LLAVA_TEMPLATE)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return model, processor


def llava_dir(tmp_path_factory, tower: str = "clip") -> tuple[Path, object, object]:
    """The tiny LLaVA (tower "clip" or "siglip") saved once per test session (every module
    that asks shares it): (folder, transformers model, processor)."""
    import transformers

    out = tmp_path_factory.getbasetemp() / ("tiny-llava" if tower == "clip" else
                                            f"tiny-llava-{tower}")
    if not (out / "model.safetensors").is_file():
        out.mkdir(exist_ok=True)
        return (out, *make_llava(out, tower=tower))
    model = transformers.LlavaForConditionalGeneration.from_pretrained(out).eval()
    return out, model, transformers.AutoProcessor.from_pretrained(out)


# Qwen2-VL's chat template, cut to what the tests use: string or parts content, an image
# part as <|vision_start|><|image_pad|><|vision_end|>.
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

QWEN_PATCH = 4          # patch_size; x merge 2 = 8-pixel grid cells
QWEN_MIN_PIXELS = 8 * 8 * 4
QWEN_MAX_PIXELS = 48 * 48   # at most 36 image tokens a picture


def make_qwen2_5_vl(out_dir: Path, seed: int = 0):
    """Save a tiny Qwen2.5-VL (3 vision blocks, block 1 full attention, the others
    windowed; a 2-layer Qwen2 decoder with M-RoPE) to out_dir; returns (model, processor)."""
    import torch
    import transformers
    from tokenizers import AddedToken

    from gpu.tokenizers.files import load_tokenizer

    hf = load_tokenizer(None).hf
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (
        "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")])
    ids = {t: hf.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>",
                                          "<|image_pad|>", "<|video_pad|>")}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=hf, bos_token="<|im_start|>",
                                               eos_token="<|im_end|>", pad_token="<|im_end|>")
    text = dict(vocab_size=max(ids.values()) + 1, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]},
                eos_token_id=hf.token_to_id("<|im_end|>"),
                bos_token_id=hf.token_to_id("<|im_start|>"), tie_word_embeddings=False)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                  patch_size=QWEN_PATCH, spatial_merge_size=2, temporal_patch_size=2,
                  window_size=16, out_hidden_size=64, fullatt_block_indexes=[1],
                  hidden_act="silu")
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():   # norms and biases away from their 1/0 init, so loading them wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
            elif p.dim() >= 2:
                p.mul_(3.0)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    images = Qwen2VLImageProcessorPil(patch_size=QWEN_PATCH, merge_size=2, temporal_patch_size=2,
                                      min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS)
    tok.chat_template = QWEN_VL_TEMPLATE
    model.save_pretrained(out_dir, safe_serialization=True)
    images.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return model, qwen_vl_processor(images, tok)


def qwen_vl_processor(images, tok):
    """The Qwen2.5-VL processor without its video processor (which needs torchvision,
    not installed here): pictures and text only."""
    import transformers

    class ImagesOnly(transformers.Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

    return ImagesOnly(image_processor=images, tokenizer=tok, video_processor=None,
                      chat_template=QWEN_VL_TEMPLATE)


def qwen_vl_dir(tmp_path_factory) -> tuple[Path, object, object]:
    """The tiny Qwen2.5-VL saved once per test session: (folder, transformers model, processor)."""
    import transformers

    out = tmp_path_factory.getbasetemp() / "tiny-qwen2_5_vl"
    if not (out / "model.safetensors").is_file():
        out.mkdir(exist_ok=True)
        return (out, *make_qwen2_5_vl(out))
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    return out, model, qwen_vl_processor(Qwen2VLImageProcessorPil.from_pretrained(out),
                                         transformers.AutoTokenizer.from_pretrained(out))
