"""A prompt with pictures (issue 34), torch-free: the pictures' parts found in the
template's messages (stages/api/chat.py `content_text` leaves them as {"type": "image",
"image_url": URL, "param": ...}), fetched (stages/media/fetch.py) and made pixel values
(stages/media/images.py); the messages put in the form the chat template reads; and each
picture's one placeholder token in the rendered prompt expanded to the model's count, as
the Hugging Face processor expands it, so the prompt's tokens are the processor's."""
from __future__ import annotations

import re

from gpu.interface import ImageInput
from gpu.config.vision import QwenImageProcessing, VisionSpec
from stages.media import images as imaging
from stages.media.fetch import MediaError, MediaSettings, load

# a template that loops over a message's content takes it as parts (vLLM's "openai"
# content format); one that does not gets the text with the image token in it ("string")
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+[\w.]*(\[['\"]content['\"]\]|\.content)")


def image_parts(messages: list[dict]) -> list[dict]:
    """Every picture's part, in prompt order."""
    return [p for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p["type"] == "image"]


def check_limit(parts: list[dict], settings: MediaSettings) -> None:
    limit = settings.limit("image")
    if len(parts) > limit:
        raise MediaError(f"At most {limit} image(s) may be provided in one prompt; "
                         f"'{parts[limit]['param']}' is image {limit + 1} "
                         "(--limit-mm-per-prompt).", parts[limit]["param"])


def load_images(parts: list[dict], spec: VisionSpec, settings: MediaSettings,
                options: dict | None = None) -> list[tuple]:
    """Each part's (pixel values, content hash, grid: Qwen2.5-VL's patch grid, else
    None); MediaError naming the part it fails on. options: the request's
    mm_processor_kwargs (validated before anything is fetched)."""
    processing = spec.processing
    if options:
        if not isinstance(processing, QwenImageProcessing):
            raise MediaError("'mm_processor_kwargs': this model's image processor takes no "
                             f"options (got {', '.join(map(repr, options))}).",
                             "mm_processor_kwargs")
        try:
            processing = processing.with_options(options)
        except ValueError as exc:
            raise MediaError(f"'mm_processor_kwargs': {exc}.", "mm_processor_kwargs") from None
    out = []
    for p in parts:
        data = load(p["image_url"], settings, p["param"])
        try:
            img = imaging.decode(data)
            if isinstance(processing, QwenImageProcessing):
                pixels, grid = imaging.qwen_patches(img, processing)
            else:
                pixels, grid = imaging.pixel_values(img, processing), None
        except imaging.ImageError as exc:
            raise MediaError(f"'{p['param']}': {exc}.", p["param"]) from None
        out.append((pixels, imaging.content_hash(pixels, grid), grid))
    return out


def image_tokens(spec: VisionSpec, grid) -> int:
    """A picture's placeholder count: fixed (LLaVA), or its merged patches (Qwen2.5-VL)."""
    if grid is None:
        return spec.tokens_per_image
    t, h, w = grid
    return t * h * w // spec.processing.merge_size ** 2


def template_form(messages: list[dict], template: str | None, spec: VisionSpec) -> list[dict]:
    """The messages as the chat template reads pictures: parts ({"type": "image"} and
    text parts) for a template that loops over content, else the text with the image
    token (and a newline) where each picture was."""
    as_parts = bool(template) and _LOOPS_OVER_CONTENT.search(template) is not None
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            if as_parts:
                content = [{"type": "image"} if p["type"] == "image"
                           else {"type": "text", "text": p["text"]} for p in content]
            else:
                content = "".join(spec.image_token + "\n" if p["type"] == "image"
                                  else p["text"] for p in content)
            m = {**m, "content": content}
        out.append(m)
    return out


def expand(ids: list[int], spec: VisionSpec, loaded: list[tuple],
           param: str) -> tuple[list[int], tuple[ImageInput, ...]]:
    """Each picture's placeholder token made as many as the picture takes (image_tokens);
    the pictures with their places. The prompt must hold one placeholder per picture."""
    places = [i for i, t in enumerate(ids) if t == spec.image_token_id]
    if len(places) != len(loaded):
        raise MediaError(f"The rendered prompt has {len(places)} image placeholder(s) "
                         f"({spec.image_token!r}) for {len(loaded)} image(s): the chat "
                         "template must place each picture once, and text may not hold "
                         "the placeholder itself.", param)
    out: list[int] = []
    inputs = []
    prev = 0
    for place, (pixels, h, grid) in zip(places, loaded):
        n = image_tokens(spec, grid)
        out += ids[prev:place]
        inputs.append(ImageInput(len(out), n, h, pixels, grid))
        out += [spec.image_token_id] * n
        prev = place + 1
    out += ids[prev:]
    return out, tuple(inputs)
