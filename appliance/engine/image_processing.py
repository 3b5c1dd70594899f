"""Images for Qwen3-VL: decoding untrusted bytes with Pillow and preprocessing them exactly as the reference
processor (transformers' Qwen2VLImageProcessor, PIL backend) does.

Policies:
- Only JPEG, PNG and WebP are decoded (Pillow is told to try no other format). The EXIF orientation is applied,
  transparency is composited onto white, everything else is converted to RGB; an animated file gives its first
  frame. Any problem with the bytes (empty, corrupt, zero-size, more than `max_decoded_pixels`, another
  format) is an ImageError, a ValueError the server turns into a 400. The pixel count is checked from the
  header before the pixels are decoded, so a decompression bomb never allocates.
- Preprocessing follows the processor step by step so the pixel values are bit-identical: smart resize to
  multiples of patch*merge within [min_pixels, max_pixels], Pillow bicubic resampling on uint8, rescale in
  float64 then float32, normalise in float32, temporal duplication of the single frame, and patches ordered
  merge-block by merge-block (the order the vision tower's merger expects).
"""
from __future__ import annotations

import io
import json
import math
import os
import struct
import warnings
from dataclasses import dataclass, replace

import numpy as np

FORMATS = ("JPEG", "PNG", "WEBP")
MAX_DECODED_PIXELS = 64_000_000  # decoded image size limit (before resizing): ~8000x8000


class ImageError(ValueError):
    """The image cannot be used (unsupported type, corrupt, empty, too large)."""


def decode_image(data: bytes, max_decoded_pixels: int = MAX_DECODED_PIXELS):
    """Bytes of a JPEG/PNG/WebP file -> an upright RGB PIL image."""
    # the plugins are named so that a frozen build has them
    from PIL import Image, ImageOps, JpegImagePlugin, PngImagePlugin, WebPImagePlugin  # noqa: F401

    if not data:
        raise ImageError("the image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            w, h = img.size
            if w <= 0 or h <= 0:
                raise ImageError(f"the image has zero size ({w}x{h})")
            if w * h > max_decoded_pixels:
                raise ImageError(f"the image is too large ({w}x{h} pixels; at most {max_decoded_pixels} pixels)")
            img.load()
            return to_rgb(ImageOps.exif_transpose(img))
    except ImageError:
        raise
    except Image.UnidentifiedImageError:
        if looks_supported(data):  # the signature is right but the header is not (zero size, damage)
            raise ImageError("the image is corrupt (bad header)") from None
        raise ImageError("unsupported image type (JPEG, PNG and WebP are accepted)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError("the image is too large") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, MemoryError) as e:
        raise ImageError(f"the image is corrupt: {e}") from None


def looks_supported(data: bytes) -> bool:
    """The file signature of a JPEG, PNG or WebP file."""
    return (data[:3] == b"\xff\xd8\xff" or data[:8] == b"\x89PNG\r\n\x1a\n"
            or (data[:4] == b"RIFF" and data[8:12] == b"WEBP"))


def to_rgb(img):
    """RGB as the reference processor's convert_to_rgb: transparency composited onto white."""
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The reference's target size: both sides multiples of factor, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"the image's aspect ratio must be below 200 (got {width}x{height})")
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


@dataclass
class PixelPatches:
    """One preprocessed image: flattened patches in merge-block order and its patch grid."""
    pixel_values: np.ndarray  # (t*h*w, C*tp*p*p) float32
    grid_thw: tuple[int, int, int]  # patches along time, height, width
    merge_size: int

    @property
    def num_tokens(self) -> int:
        """Image-pad tokens this image takes in the prompt (one per merged 2x2 block)."""
        t, h, w = self.grid_thw
        return t * h * w // (self.merge_size ** 2)


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_dict(cls, d: dict, max_pixels: int | None = None) -> "ImageProcessor":
        """From preprocessor_config.json's keys; max_pixels (a deployment cap) lowers the model's own bound."""
        size = d.get("size") or {}
        lo = d.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels
        hi = d.get("max_pixels") or size.get("longest_edge") or cls.max_pixels
        if max_pixels is not None:
            hi = min(hi, max_pixels)
        return cls(patch_size=int(d.get("patch_size", cls.patch_size)),
                   temporal_patch_size=int(d.get("temporal_patch_size", cls.temporal_patch_size)),
                   merge_size=int(d.get("merge_size", cls.merge_size)),
                   min_pixels=int(lo), max_pixels=int(max(hi, lo)),
                   image_mean=tuple(float(x) for x in d.get("image_mean", cls.image_mean)),
                   image_std=tuple(float(x) for x in d.get("image_std", cls.image_std)),
                   rescale_factor=float(d.get("rescale_factor", cls.rescale_factor)),
                   do_rescale=bool(d.get("do_rescale", True)), do_normalize=bool(d.get("do_normalize", True)))

    @classmethod
    def from_dir(cls, model_dir: str, max_pixels: int | None = None) -> "ImageProcessor":
        path = os.path.join(model_dir, "preprocessor_config.json")
        d = {}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        return cls.from_dict(d, max_pixels)

    def capped(self, max_pixels: int) -> "ImageProcessor":
        """The same processor with the upper pixel bound lowered to max_pixels (never below min_pixels)."""
        return replace(self, max_pixels=max(self.min_pixels, min(self.max_pixels, int(max_pixels))))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def preprocess(self, img) -> PixelPatches:
        """An RGB PIL image -> PixelPatches."""
        from PIL import Image

        h, w = self.target_size(img.height, img.width)
        resized = img.resize((w, h), resample=Image.Resampling.BICUBIC)
        x = np.asarray(resized).transpose(2, 0, 1)  # (C, H, W) uint8
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            x = x.astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, np.float32)[:, None, None]
            std = np.asarray(self.image_std, np.float32)[:, None, None]
            x = (x - mean) / std
        return self.patchify(x)

    def patchify(self, x: np.ndarray) -> PixelPatches:
        """(C, H, W) float32 -> patches ordered (block row, block col, row in block, col in block)."""
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        C, H, W = x.shape
        gh, gw = H // p, W // p
        x = x.reshape(C, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))  # the frame repeated tp times
        return PixelPatches(np.ascontiguousarray(x.reshape(gh * gw, C * tp * p * p), np.float32), (1, gh, gw), m)

    def load(self, data: bytes, max_decoded_pixels: int = MAX_DECODED_PIXELS) -> PixelPatches:
        return self.preprocess(decode_image(data, max_decoded_pixels))
