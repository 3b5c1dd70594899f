"""Image content parts of a chat request -> the prompt's image tokens and the engine's preprocessed images.

Policies:
- Sources: `data:image/...;base64,` URIs. Remote http(s) URLs are refused (the board has no network and the
  server never fetches). Local files (`file:///abs/path` or `/abs/path`) are read only when the operator
  allowed directories (`--image-dir`); the real path (symlinks resolved) must lie inside one of them and be a
  regular file (opened non-blocking and checked with fstat, so a FIFO or device never blocks; a NUL byte in
  the path is refused). Anything else is refused. Every refusal is an ImageError (a ValueError -> 400) naming the part.
- Sizes: image bytes count against the request body limit. A data URI is inside the body already; a local
  file's size is added to the body's and the sum must stay within the limit (ImageBytesLimit -> 413). The
  pixel and token limits are the image processor's (max_pixels) and the context's (the caller checks).
- `prepare_images` is synchronous CPU work (base64, Pillow decode, resize, patchify): the server runs it in a
  worker thread, never inside async code. It never touches the model, so it may run beside the engine. It
  checks `should_stop` before each image (the client left): the remaining images are never decoded.
"""
from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from typing import Any, Sequence

from ..engine.image_processing import ImageError, ImageProcessor, PixelPatches, decode_image
from ..engine.qwen3_vl import expand_image_pads
from ..protocol.messages import part_param

_DATA_URI = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


class ImageTokensOverContext(ImageError):
    """The images alone need more tokens than the context holds."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(f"the images need at least {tokens} tokens; the context holds {limit}")
        self.tokens, self.limit = tokens, limit


class InvalidImage(ImageError):
    """One image could not be used; `where` is the field the client sent it as."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"Invalid image in '{where}': {reason}.")
        self.where = where


class ImagesAbandoned(ImageError):
    """should_stop() turned true between images: nobody waits for the result any more."""


class ImageBytesLimit(ImageError):
    """The images' bytes (with the request body) exceed the body limit."""

    def __init__(self, limit: int):
        super().__init__(f"the images exceed the request size limit of {limit} bytes")
        self.limit = limit


def image_urls(messages: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(where, url) of every image part in prompt order (message order, then part order); `where` is the field
    the client sent it as (messages[i].content[j], or what an Ollama / Responses request called it)."""
    out = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    out.append((part_param(part, f"messages[{i}].content[{j}]"), part["image_url"]["url"]))
    return out


def decode_data_uri(url: str) -> bytes:
    m = _DATA_URI.match(url)
    if m is None:
        raise ImageError("malformed data URI")
    mime = (m.group("mime") or "").lower()
    if not mime.startswith("image/"):
        raise ImageError(f"unsupported data URI type {mime or 'text/plain'!r} "
                         f"(send image/jpeg, image/png or image/webp)")
    if not m.group("b64"):
        raise ImageError("data URIs must be base64-encoded")
    payload = "".join(url[m.end():].split())  # clients may wrap base64 lines
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("invalid base64 in the data URI") from None


def local_path(url: str) -> str | None:
    if url.startswith("file://"):
        rest = url[len("file://"):]
        if not rest.startswith("/"):
            raise ImageError("file URLs must be absolute (file:///path)")
        return rest
    return url if url.startswith("/") else None


def read_local_file(path: str, allowed_dirs: Sequence[str], budget: int) -> bytes:
    if not allowed_dirs:
        raise ImageError("local image files are not enabled on this server (send a data: URI)")
    if "\x00" in path:
        raise ImageError("the image path contains a NUL byte")
    real = os.path.realpath(path)
    roots = [os.path.realpath(d) for d in allowed_dirs]
    if not any(os.path.commonpath([real, r]) == r for r in roots):
        raise ImageError("the image file is outside the allowed directories")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        raise ImageError("the image file cannot be read") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageError("the image path is not a regular file")
        if st.st_size > budget:
            raise ImageBytesLimit(-1)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(st.st_size + 1)
    except OSError:
        raise ImageError("the image file cannot be read") from None
    finally:
        os.close(fd)
    if len(data) > budget:
        raise ImageBytesLimit(-1)
    return data


def load_image_bytes(url: str, allowed_dirs: Sequence[str] = (), budget: int = 1 << 62) -> bytes:
    """The bytes an image_url names; budget bounds what a local file may add to the request."""
    low = url[:16].lower()
    if low.startswith("data:"):
        return decode_data_uri(url)
    if low.startswith(("http://", "https://")):
        raise ImageError("remote image URLs are not supported (the server does not fetch); send a data: URI")
    path = local_path(url)
    if path is None:
        raise ImageError("unsupported image URL (send a data: URI)")
    return read_local_file(path, allowed_dirs, budget)


def prepare_images(processor: ImageProcessor, image_token_id: int, prompt_ids: list[int],
                   urls: Sequence[tuple[str, str]], *, allowed_dirs: Sequence[str] = (), body_size: int = 0,
                   body_limit: int = 1 << 62, max_tokens: int = 1 << 62, should_stop=lambda: False,
                   on_decoded=lambda: None) -> tuple[list[int], list[PixelPatches]]:
    """Load and preprocess every image, expand each image-pad token into the image's token count.
    Errors are ImageError with the part named (ImageBytesLimit when local files break the body limit,
    ImageTokensOverContext as soon as the images' tokens alone pass max_tokens: later images are never
    preprocessed, so a request cannot make the server hold more patches than one context's worth)."""
    patches = []
    used, tokens = body_size, 0
    for where, url in urls:
        if should_stop():
            raise ImagesAbandoned("the client went away")
        try:
            data = load_image_bytes(url, allowed_dirs, body_limit - used)
            if not url[:5].lower().startswith("data:"):
                used += len(data)
            img = decode_image(data)
            on_decoded()
            h, w = processor.target_size(img.height, img.width)
            tokens += h * w // (processor.factor ** 2)
            if tokens >= max_tokens:
                raise ImageTokensOverContext(tokens, max_tokens)
            patches.append(processor.preprocess(img))
            del img  # the decoded pixels go before the next image is read (and before a stop)
        except (ImageTokensOverContext, ImagesAbandoned):
            raise
        except ImageBytesLimit:
            raise ImageBytesLimit(body_limit) from None
        except ImageError as e:
            raise InvalidImage(where, str(e)) from None
    return expand_image_pads(prompt_ids, image_token_id, [p.num_tokens for p in patches]), patches
