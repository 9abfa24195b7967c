"""Pictures to pixel values, torch-free (numpy and Pillow), in render (issue 34): decode,
convert to RGB, resize, centre crop, rescale and normalise as the model's image processor
(gpu/vision_config.py `ImageProcessing`) says, the steps and rounding of transformers'
CLIPImageProcessor (its PIL backend), so the pixel values are the Hugging Face
processor's. A content hash names each picture: the encoder cache and the prefix cache
key on it."""
from __future__ import annotations

import hashlib
import io
import math
import warnings

import numpy as np
from PIL import Image

from gpu.vision_config import ImageProcessing

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
    if proc.do_rescale:
        image = (image.astype(np.float64) * proc.rescale_factor).astype(np.float32)
    else:
        image = image.astype(np.float32)
    if proc.do_normalize:
        mean = np.array(proc.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(proc.image_std, dtype=np.float32)[:, None, None]
        image = (image - mean) / std
    return np.ascontiguousarray(image, dtype=np.float32)


def content_hash(pixels: np.ndarray) -> str:
    """The picture's identity as the model sees it (its pixel values)."""
    h = hashlib.sha256()
    h.update(repr(pixels.shape).encode())
    h.update(pixels.tobytes())
    return h.hexdigest()[:32]
