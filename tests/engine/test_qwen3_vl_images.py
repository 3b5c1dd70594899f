"""Image decoding and preprocessing against transformers' Qwen3-VL processor (PIL backend) and load_image."""
import base64
import io

import numpy as np
import pytest
from PIL import Image
from transformers.image_utils import load_image

from appliance.engine.image_processing import ImageError, ImageProcessor, decode_image
from tests.support.tiny_vl import cached_qwen3_vl, image_bytes, png_with_size, reference_processor


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return cached_qwen3_vl(tmp_path_factory)


@pytest.fixture(scope="module")
def processors(vl_dir):
    return ImageProcessor.from_dir(vl_dir), reference_processor(vl_dir).image_processor


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def check_same(ours_proc, ref_proc, pil_ours, pil_ref):
    ours = ours_proc.preprocess(pil_ours)
    ref = ref_proc(images=[pil_ref], return_tensors="np")
    assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.shape == ref["pixel_values"].shape
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"])
    return ours


@pytest.mark.parametrize("w,h,fmt,mime", [
    (300, 200, "PNG", "image/png"),     # non-square, rounded to multiples of 32
    (150, 250, "JPEG", "image/jpeg"),   # portrait
    (40, 30, "PNG", "image/png"),       # below min_pixels: upscaled
    (900, 500, "WEBP", "image/webp"),   # above max_pixels: downscaled
    (333, 97, "JPEG", "image/jpeg"),
])
def test_pixel_values_and_grid_equal_the_processor(processors, w, h, fmt, mime):
    ours_proc, ref_proc = processors
    data = image_bytes(w, h, fmt, seed=w)
    out = check_same(ours_proc, ref_proc, decode_image(data), load_image(data_uri(data, mime)))
    t, gh, gw = out.grid_thw
    assert t == 1 and gh % 2 == 0 and gw % 2 == 0
    assert ours_proc.min_pixels <= gh * gw * 256 <= ours_proc.max_pixels


def test_exif_orientation_is_applied(processors):
    ours_proc, ref_proc = processors
    img = Image.open(io.BytesIO(image_bytes(320, 160, "PNG", seed=5))).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif.tobytes())
    data = buf.getvalue()
    upright = decode_image(data)
    assert upright.size == (160, 320)  # height and width swapped by the orientation tag
    check_same(ours_proc, ref_proc, upright, load_image(data_uri(data, "image/jpeg")))


def test_transparency_is_composited_on_white_like_the_processor(processors):
    ours_proc, ref_proc = processors
    data = image_bytes(200, 120, "PNG", mode="RGBA", seed=9)
    ours = decode_image(data)
    assert ours.mode == "RGB"
    check_same(ours_proc, ref_proc, ours, Image.open(io.BytesIO(data)))  # the processor converts RGBA itself


@pytest.mark.parametrize("mode", ["L", "P", "CMYK"])
def test_other_modes_become_rgb(processors, mode):
    ours_proc, ref_proc = processors
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    data = image_bytes(130, 170, fmt, mode=mode, seed=2)
    check_same(ours_proc, ref_proc, decode_image(data), Image.open(io.BytesIO(data)))


def test_max_pixels_cap_lowers_the_token_count(vl_dir):
    model_default = ImageProcessor.from_dir(vl_dir)
    capped = ImageProcessor.from_dir(vl_dir, max_pixels=32 * 32 * 8)
    img = decode_image(image_bytes(900, 500, "PNG"))
    assert capped.preprocess(img).num_tokens <= 8 < model_default.preprocess(img).num_tokens
    assert model_default.capped(32 * 32 * 8) == capped  # the --image-max-pixels path
    assert model_default.capped(1).max_pixels == model_default.min_pixels  # never below the model's minimum


@pytest.mark.parametrize("data,message", [
    (b"", "empty"),
    (b"not an image at all", "unsupported"),
    (image_bytes(64, 64, "GIF"), "unsupported"),
    (image_bytes(64, 64, "BMP"), "unsupported"),
    (image_bytes(200, 200, "JPEG")[:300], "corrupt"),
    (image_bytes(200, 200, "PNG")[:-40], "corrupt"),
    (png_with_size(100_000, 100_000), "too large"),
    (png_with_size(0, 10), "corrupt"),
    (image_bytes(400, 1, "PNG"), "aspect ratio"),
])
def test_bad_images_are_image_errors(vl_dir, data, message):
    proc = ImageProcessor.from_dir(vl_dir)
    with pytest.raises(ImageError, match=message):
        proc.load(data)
    assert issubclass(ImageError, ValueError)
