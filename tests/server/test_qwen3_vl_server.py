"""Images through the real server (worker thread + trio + h11 on a loopback socket) with the official openai
client: a streamed answer to a data-URI image equals transformers' greedy answer; several images per message
and per conversation; local files only under --image-dir; refusals are OpenAI error JSON with 400 (413 for
the body limit); image tokens and encode time in usage, timings and the metrics event."""
from __future__ import annotations

import base64
import json
import os

import openai
import pytest
import torch
from transformers.image_utils import load_image

from appliance.engine.image_processing import ImageError
from appliance.server.images import decode_data_uri, image_urls, load_image_bytes
from tests.support.live_server import LiveServer, RawClient, request_bytes
from tests.support.tiny_vl import cached_qwen3_vl, image_bytes, png_with_size, reference_processor

PNG = image_bytes(300, 200, "PNG", seed=11)
JPEG = image_bytes(150, 250, "JPEG", seed=12)
WEBP = image_bytes(120, 90, "WEBP", seed=13)


def uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


# ---- the URL rules (pure functions) ---------------------------------------------------------------------

def test_data_uri_decoding_and_refusals():
    assert decode_data_uri(uri(PNG)) == PNG
    b64 = base64.b64encode(JPEG).decode()
    wrapped = "data:image/jpeg;base64," + "\r\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
    assert decode_data_uri(wrapped) == JPEG
    for bad, msg in [("data:text/plain;base64,aGk=", "unsupported data URI type"),
                     ("data:image/png,%89PNG", "base64"),
                     ("data:image/png;base64,@@@@", "invalid base64"),
                     ("data:image/png;base64", "malformed")]:
        with pytest.raises(ImageError, match=msg):
            decode_data_uri(bad)
    for bad, msg in [("https://example.com/cat.png", "remote image URLs"), ("HTTP://x/y.png", "remote"),
                     ("ftp://x/y.png", "unsupported image URL"), ("cat.png", "unsupported image URL"),
                     ("/etc/passwd", "not enabled"), ("file://etc/passwd", "absolute")]:
        with pytest.raises(ImageError, match=msg):
            load_image_bytes(bad)


def test_local_files_only_inside_the_allowed_dirs(tmp_path):
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir(), other.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (other / "b.png").write_bytes(PNG)
    os.symlink(other / "b.png", allowed / "link.png")
    assert load_image_bytes(str(allowed / "a.png"), [str(allowed)]) == PNG
    assert load_image_bytes("file://" + str(allowed / "a.png"), [str(allowed)]) == PNG
    for path in (other / "b.png", allowed / "link.png", allowed / ".." / "other" / "b.png"):
        with pytest.raises(ImageError, match="outside the allowed"):
            load_image_bytes(str(path), [str(allowed)])
    with pytest.raises(ImageError, match="cannot be read"):
        load_image_bytes(str(allowed / "missing.png"), [str(allowed)])


def test_image_urls_in_prompt_order():
    msgs = [{"role": "system", "content": "s"}, user("x", image_part("a"), image_part("b")),
            {"role": "assistant", "content": "y"}, user(image_part("c"))]
    assert image_urls(msgs) == [("messages[1].content[1]", "a"), ("messages[1].content[2]", "b"),
                                ("messages[3].content[0]", "c")]


# ---- through the server -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return cached_qwen3_vl(tmp_path_factory)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    (d / "photo.webp").write_bytes(WEBP)
    return d


@pytest.fixture(scope="module")
def server(vl_dir, image_dir):
    s = LiveServer(vl_dir, queue=2, ctx=512, prefill_chunk=32, max_body=1_000_000)
    s.api_cfg.image_dirs = (str(image_dir),)
    with s:
        yield s


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def transformers_answer(vl_dir, messages, images, n):
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    proc = reference_processor(vl_dir)
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    return proc.tokenizer.decode(ids, skip_special_tokens=True), inputs["input_ids"].shape[1]


def test_streamed_answer_to_a_data_uri_image_equals_transformers(client, server, vl_dir):
    messages = [user("What is in this picture?", image_part(uri(PNG)))]
    parts, usage = [], None
    stream = client.chat.completions.create(model="tiny", messages=messages, stream=True, max_tokens=16,
                                            temperature=0, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(parts) > 2  # token by token, not one lump
    want, n_prompt = transformers_answer(vl_dir, messages, [load_image(uri(PNG))], 16)
    assert "".join(parts) == want
    assert usage.prompt_tokens == n_prompt and usage.completion_tokens == 16
    details = usage.prompt_tokens_details  # the openai client's own fields
    assert details.image_tokens == 54 and details.text_tokens == n_prompt - 54  # 288x192 px -> 18x12 patches -> 54


def test_several_images_per_message_and_conversation(client, image_dir):
    messages = [user("Compare", image_part(uri(PNG)), "and", image_part(uri(JPEG, "image/jpeg"))),
                {"role": "assistant", "content": "They differ."},
                user(image_part(str(image_dir / "photo.webp")), "And this one?")]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert resp.choices[0].finish_reason in ("length", "stop")
    n_images = resp.usage.prompt_tokens_details.image_tokens
    assert n_images == 54 + 40 + 12  # 300x200, 150x250 (->160x256), 120x90 (->128x96, min_pixels)
    assert resp.model_extra["timings"]["image_tokens"] == n_images
    assert resp.model_extra["timings"]["image_encode_ms"] > 0


def test_metrics_event_reports_image_tokens_and_encode_time(server):
    body = {"model": "tiny", "messages": [user(image_part(uri(PNG)), "Describe.")], "stream": True,
            "max_tokens": 3, "stream_options": {"include_metrics": True}}
    c = RawClient(server.port)
    try:
        c.send(request_bytes("POST", "/v1/chat/completions", body))
        r = c.read_head()
        assert r.status == 200
        events = c.read_events(r).json_events()
    finally:
        c.close()
    metrics = [e for e in events if e.get("object") == "chat.completion.metrics"]
    assert len(metrics) == 1
    m = metrics[0]["metrics"]
    assert m["image_tokens"] == 54 and m["image_encode_ms"] > 0 and m["prompt_tokens"] > 54


@pytest.mark.parametrize("url,code,fragment", [
    ("https://example.com/cat.png", "invalid_image", "remote image URLs are not supported"),
    ("data:image/png;base64,not base64!", "invalid_image", "invalid base64"),
    (uri(b"GIF89a" + b"\0" * 40, "image/gif"), "invalid_image", "unsupported image type"),
    (uri(PNG[:200]), "invalid_image", "corrupt"),
    (uri(b""), "invalid_image", "empty"),
    (uri(png_with_size(100_000, 100_000)), "invalid_image", "too large"),
    (uri(png_with_size(0, 10)), "invalid_image", "corrupt"),
    ("/etc/hostname", "invalid_image", "outside the allowed directories"),
    ("data:text/html;base64,PGgxPg==", "invalid_image", "unsupported data URI type"),
])
def test_refused_images_are_400_error_json(client, url, code, fragment):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[user("Look:", image_part(url))], max_tokens=2,
                                       stream=True)
    err = e.value.body
    assert e.value.status_code == 400 and err["code"] == code and err["param"] == "messages"
    assert fragment in err["message"] and "messages[0].content[1]" in err["message"]
    assert err["type"] == "invalid_request_error"


def test_image_tokens_count_against_the_context(vl_dir):
    with LiveServer(vl_dir, queue=0, ctx=64) as s:  # the text alone fits; with 54 image tokens it does not
        with openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
            ok = c.chat.completions.create(model="tiny", messages=[user("Describe it.")], max_tokens=2)
            assert ok.usage.prompt_tokens + 2 + 54 + 2 > 64  # + vision start/end + 54 image tokens + max_tokens
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="tiny", messages=[user("Describe it.", image_part(uri(PNG)))],
                                          max_tokens=2)
            assert e.value.body["code"] == "context_length_exceeded"
            with pytest.raises(openai.BadRequestError) as e:  # two images: refused while sizing them
                c.chat.completions.create(model="tiny", messages=[user(image_part(uri(PNG)), image_part(uri(PNG)))])
    assert e.value.body["code"] == "context_length_exceeded"
    assert "the images need at least 108" in e.value.body["message"]


def test_images_over_the_context_are_refused_before_preprocessing_the_rest(monkeypatch):
    from appliance.engine.image_processing import ImageProcessor
    from appliance.server import images as image_inputs

    proc = ImageProcessor(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 64)
    seen = []
    real = ImageProcessor.preprocess
    monkeypatch.setattr(ImageProcessor, "preprocess", lambda self, img: seen.append(img.size) or real(self, img))
    urls = [(f"messages[0].content[{i}]", uri(PNG)) for i in range(5)]  # 54 tokens each
    with pytest.raises(image_inputs.ImageTokensOverContext) as e:
        image_inputs.prepare_images(proc, 151655, [151655] * 5, urls, max_tokens=120)
    assert e.value.tokens == 162 and len(seen) == 2  # the third image is sized, never preprocessed
    ids, patches = image_inputs.prepare_images(proc, 151655, [1, 151655, 2], urls[:1], max_tokens=120)
    assert ids == [1] + [151655] * 54 + [2] and patches[0].num_tokens == 54


def test_image_bytes_count_against_the_body_limit(client, server, image_dir):
    big = image_bytes(800, 800, "PNG", seed=3)  # noise compresses badly: above the 1 MB body limit
    assert len(big) > 1_000_000
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="tiny", messages=[user(image_part(uri(big)))], max_tokens=2)
    assert e.value.status_code == 413
    (image_dir / "big.png").write_bytes(big)  # a local file's bytes count too
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="tiny", messages=[user(image_part(str(image_dir / "big.png")))],
                                       max_tokens=2)
    assert e.value.status_code == 413 and e.value.body["type"] == "invalid_request_error"
    json.dumps(e.value.body)
