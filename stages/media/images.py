"""Pictures to pixel values, torch-free (numpy and Pillow), in render (issue 34): decode,
convert to RGB, resize, centre crop, rescale and normalise as the model's image processor
(gpu/config/vision.py `ImageProcessing`) says, the steps and rounding of transformers'
CLIPImageProcessor and SiglipImageProcessor (their PIL backends; SigLIP's resizes to
height x width and crops nothing), so the pixel values are the Hugging Face processor's.
A content hash names each picture: the encoder cache and the prefix cache key on it."""
from __future__ import annotations

import hashlib
import io
import math
import warnings

import numpy as np
from PIL import Image

from gpu.config.vision import ImageProcessing, QwenImageProcessing

MAX_PIXELS = 64_000_000     # a decoded picture larger than this is refused (a decompression bomb)


class ImageError(ValueError):
    """The bytes are not a picture this server can read."""


def decode(data: bytes) -> Image.Image:
    """Bytes -> a loaded PIL image; ImageError when they are not a picture."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > MAX_PIXELS:
                raise ImageError(f"the image is {img.width}x{img.height}, more than "
                                 f"{MAX_PIXELS} pixels")
            img.load()
    except ImageError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as exc:
        raise ImageError(f"the data is not an image Pillow can read ({exc})") from None
    return img


def _shortest_edge_size(height: int, width: int, size: int) -> tuple[int, int]:
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _center_crop(image: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """[C, H, W] -> [C, crop_h, crop_w], zero-padded first when the picture is smaller."""
    _, h, w = image.shape
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    if top >= 0 and left >= 0:
        return image[:, top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    padded = np.zeros(image.shape[:1] + (new_h, new_w), dtype=image.dtype)
    tp, lp = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[:, tp:tp + h, lp:lp + w] = image
    top, left = top + tp, left + lp
    top, left = max(top, 0), max(left, 0)
    return padded[:, top:top + crop_h, left:left + crop_w]


def pixel_values(img: Image.Image, proc: ImageProcessing) -> np.ndarray:
    """A PIL image -> float32 [3, H, W], as the model's processor makes it."""
    if proc.do_convert_rgb and img.mode != "RGB":
        img = img.convert("RGB")
    if proc.do_resize:
        if proc.shortest_edge is not None:
            h, w = _shortest_edge_size(img.height, img.width, proc.shortest_edge)
        else:
            h, w = proc.resize_to
        img = img.resize((w, h), resample=proc.resample)
    arr = np.asarray(img)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    image = arr.transpose(2, 0, 1)                        # [C, H, W], uint8
    if proc.do_center_crop:
        image = _center_crop(image, *proc.crop_size)
    return _rescale_normalize(image, proc)


def _rescale_normalize(image: np.ndarray, proc) -> np.ndarray:
    """uint8 [C, H, W] -> float32, rescaled and normalised as transformers' numpy steps do."""
    if proc.do_rescale:
        image = (image.astype(np.float64) * proc.rescale_factor).astype(np.float32)
    else:
        image = image.astype(np.float32)
    if proc.do_normalize:
        mean = np.array(proc.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(proc.image_std, dtype=np.float32)[:, None, None]
        image = (image - mean) / std
    return np.ascontiguousarray(image, dtype=np.float32)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of `factor`, the pixel count within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"the image is {width}x{height}: its aspect ratio is more than 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_patches(img: Image.Image, proc: QwenImageProcessing
                 ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """A PIL image -> Qwen2-VL's flattened patches float32 [t*h*w, C*T*P*P] (the merge
    blocks' patches together, each patch's values by channel, temporal copy, row, column)
    and its grid (t, h, w) in patches, as Qwen2VLImageProcessor makes them."""
    if proc.do_convert_rgb and img.mode != "RGB":
        img = img.convert("RGB")
    p, m, tp = proc.patch_size, proc.merge_size, proc.temporal_patch_size
    if proc.do_resize:
        h, w = smart_resize(img.height, img.width, p * m, proc.min_pixels, proc.max_pixels)
        img = img.resize((w, h), resample=proc.resample)
    arr = np.asarray(img)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    image = _rescale_normalize(arr.transpose(2, 0, 1), proc)       # [C, H, W]
    c, height, width = image.shape
    if height % (p * m) or width % (p * m):
        raise ImageError(f"the image is {width}x{height}, not a multiple of {p * m} "
                         "(do_resize is off in the processor config)")
    gh, gw = height // p, width // p
    x = image.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (tp,) + x.shape[5:])
    patches = np.ascontiguousarray(x.reshape(gh * gw, c * tp * p * p), dtype=np.float32)
    return patches, (1, gh, gw)


def content_hash(pixels: np.ndarray, grid: tuple[int, ...] | None = None) -> str:
    """The picture's identity as the model sees it (its pixel values, and Qwen2.5-VL's
    patch grid, which its features and positions follow)."""
    h = hashlib.sha256()
    h.update(repr(pixels.shape if grid is None else (pixels.shape, tuple(grid))).encode())
    h.update(pixels.tobytes())
    return h.hexdigest()[:32]
