"""The tiny llava-hf LLaVA with a SigLIP vision tower (tests/support/vision_models.py, tower
"siglip": no class token, read at its last layer with strategy "full", as
llava-interleave's layout) against transformers (issue 34): our pixel values and
placeholder counts against SiglipImageProcessor and LlavaProcessor on several sizes and
aspect ratios, and our logits against LlavaForConditionalGeneration's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.vision_models import SIGLIP_PATCH, SIGLIP_SIZE, llava_dir
from tests.support.hf_models import our_logits

TOKENS = (SIGLIP_SIZE // SIGLIP_PATCH) ** 2      # 16: every patch, no class token to drop


def picture(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def siglip(tmp_path_factory):
    return llava_dir(tmp_path_factory, tower="siglip")


SIZES = [(40, 57), (57, 40), (28, 28), (12, 100), (301, 17), (8, 8), (64, 64)]


def test_pixel_values_and_placeholders_match_the_hf_processor(siglip):
    from gpu.tokenizers.tokenizer import tokenizer_from_hf_dir
    from gpu.config.vision import vision_spec
    from gpu.formats.hf import read_json
    from stages.media.images import pixel_values

    out, _, processor = siglip
    spec = vision_spec(out, read_json(out / "config.json"), tokenizer_from_hf_dir(out))
    assert not spec.processing.do_center_crop and spec.tokens_per_image == TOKENS
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True)
    for i, (h, w) in enumerate(SIZES):
        img = picture(h, w, i)
        ref = processor(images=[img], text=text, return_tensors="np")
        ours = pixel_values(img, spec.processing)
        assert ours.shape == ref["pixel_values"][0].shape == (3, SIGLIP_SIZE, SIGLIP_SIZE)
        np.testing.assert_allclose(ours, ref["pixel_values"][0], rtol=0, atol=1e-6)
        assert int((ref["input_ids"] == spec.image_token_id).sum()) == spec.tokens_per_image
    for img in (picture(20, 33, 9).convert("L"), picture(33, 20, 10).convert("RGBA")):
        ref = processor.image_processor(img, return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(pixel_values(img, spec.processing), ref, atol=1e-6)


def test_logits_match_transformers(siglip):
    from gpu.layers.attention_dense import DenseCausalAttention
    from gpu.loader.decoder import load_model
    from stages.media.images import pixel_values

    out, model, processor = siglip
    loaded = load_model(out, dtype="float32", progress=False)
    spec = loaded.vision_spec
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"},
                                      {"type": "image"}]}], add_generation_prompt=True)
    imgs = [picture(40, 57, 1), picture(50, 31, 2)]
    inputs = processor(images=imgs, text=text, return_tensors="pt")
    with torch.inference_mode():
        ref = model(**inputs).logits[0].float()
        ref_feats = model.get_image_features(
            pixel_values=inputs["pixel_values"], vision_feature_layer=-1,
            vision_feature_select_strategy="full").pooler_output
    ids = inputs["input_ids"][0].tolist()
    pixels = torch.from_numpy(np.stack([pixel_values(i, spec.processing) for i in imgs]))
    with torch.inference_mode():
        feats = loaded.vision(pixels)                                   # [2, 16, D]
    torch.testing.assert_close(feats, torch.stack(list(ref_feats)), rtol=1e-5, atol=1e-5)
    rows = torch.tensor([i for i, t in enumerate(ids) if t == spec.image_token_id])
    assert len(rows) == 2 * TOKENS
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention(None),
                              embeds=(rows, feats.reshape(-1, feats.shape[-1])))
        ours = loaded.model.compute_logits(hidden)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    plain = our_logits(loaded.model, ids)           # the picture matters
    assert (plain - ref).abs().max() > 1e-2


def test_tower_reads_other_layers_and_the_default_strategy(siglip):
    """vision_feature_layer -2, and "default" (which drops SigLIP's first patch):
    the tower's features equal transformers' get_image_features on the same weights."""
    from gpu.models.llava_vision import LlavaVision
    from gpu.formats.hf import read_json

    out, model, processor = siglip
    config = read_json(out / "config.json")
    pixels = processor.image_processor(picture(33, 45, 3), return_tensors="pt")["pixel_values"]
    state = [(k.removeprefix("model."), v) for k, v in model.state_dict().items()
             if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))]
    for layer, strategy in ((-2, "full"), (-1, "default")):
        ours = LlavaVision({**config, "vision_feature_layer": layer,
                            "vision_feature_select_strategy": strategy}, 64)
        ours.load_weights(state)
        with torch.inference_mode():
            ref = model.get_image_features(pixel_values=pixels, vision_feature_layer=layer,
                                           vision_feature_select_strategy=strategy).pooler_output
            torch.testing.assert_close(ours(pixels), torch.stack(list(ref)), rtol=1e-5, atol=1e-5)
    assert ref[0].shape[0] == TOKENS - 1
