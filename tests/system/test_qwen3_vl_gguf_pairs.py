"""llama.cpp's Qwen3-VL pairs (text GGUF + mmproj GGUF) made by llama.cpp's own converter, served by the CLI.

A tiny random Qwen3-VL (transformers, real tokenizer; tests/support/tiny_vl.py) is converted by the peer's
vendored convert_hf_to_gguf.py to F32, F16 and Q8_0 text files and mmproj files, a tiny Qwen3-VL-MoE to F32 and
Q8_0 ones (`qwen3vlmoe`). On each pair our server, over
HTTP with the openai client, must give the prompt ids transformers' processor gives for one message with two
non-square images (the image bounds are llama.cpp's: at least 8 merged tokens; --image-max-pixels caps the top,
and the reference processor is given the same bounds). Greedy tokens: identical to transformers (float32 on
the same bf16 weights) for F32. For F16 and Q8_0 the reference is llama.cpp's mtmd on the same pair
(bench/peer_mtmd.py: the same prompt text, the same decoded RGB pixels; pictures whose size no resize changes,
lossless, since mtmd resizes its own way): its prompt ids equal ours, and its
greedy tokens equal ours, or do up to a first divergence that is a near-tie: at that step the top two logits
are within TIE_MARGIN[kind] nats of each other in both engines. Then: the one mmproj*.gguf
beside the model is used and logged; a text file without its projector serves text, says so at start-up and
refuses image parts with a 400 naming --mmproj; /props and /api/show report vision from the pair; an mmproj of
another model (another width) is refused at load, one line, exit 2.
"""
from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import urllib.request

import ollama
import openai
import pytest
import torch

from tests.support.gguf_files import mtmd_peer_module
from tests.support.llama_convert import convert_hf
from tests.support.tiny_vl import (
    build_qwen3_vl,
    cached_qwen3_vl,
    cached_qwen3_vl_moe,
    image_bytes,
    published_layout,
    reference_processor,
    write_preprocessor_config,
)

KINDS = ("f32", "f16", "q8_0")
MOE_KINDS = ("f32", "q8_0")  # Qwen3-VL-MoE (qwen3vlmoe text + its mmproj)
# nats between the top two logits, in both engines, for a divergence to count as a near-tie; wider for Q8_0,
# whose CPU dot products in llama.cpp quantize the activations to Q8_0 as well
TIE_MARGIN = {"f16": 0.05, "q8_0": 0.15}
MIN_PIXELS, MAX_PIXELS = 8 * 32 * 32, 32 * 32 * 64  # llama.cpp's lower bound for Qwen3-VL; our --image-max-pixels
IMAGES = (image_bytes(300, 200, "PNG", seed=21), image_bytes(120, 250, "JPEG", seed=22))  # 54 and 32 tokens
# for mtmd: sizes its resize keeps (multiples of 32 inside the bounds), lossless: the same pixels in both engines
MTMD_IMAGES = (image_bytes(288, 192, "PNG", seed=21), image_bytes(128, 256, "PNG", seed=22))  # 54 and 32 tokens
N_TOKENS = 12
CLI = [sys.executable, "-m", "appliance"]


def uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()




def message(first: str, second: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Compare these two pictures."},
                                         {"type": "image_url", "image_url": {"url": first}},
                                         {"type": "image_url", "image_url": {"url": second}},
                                         {"type": "text", "text": "Which is brighter?"}]}]


MESSAGES = message(uri(IMAGES[0]), uri(IMAGES[1], "image/jpeg"))
MTMD_MESSAGES = message(uri(MTMD_IMAGES[0]), uri(MTMD_IMAGES[1]))


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return cached_qwen3_vl(tmp_path_factory)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """The tiny Qwen3-VL-MoE with its experts as published (llama.cpp's converter reads that layout only)."""
    return published_layout(cached_qwen3_vl_moe(tmp_path_factory), str(tmp_path_factory.mktemp("moe") / "m"))


def convert_pairs(src: str, kinds, tmp_path_factory, stem: str) -> dict:
    """{kind: (text.gguf, mmproj.gguf)}, each pair alone in its directory, converted by llama.cpp."""
    out = {}
    for kind in kinds:
        d = tmp_path_factory.mktemp(f"{stem}-{kind}")
        out[kind] = (convert_hf(src, str(d / f"{stem}-{kind}.gguf"), kind),
                     convert_hf(src, str(d / f"mmproj-{stem}-{kind}.gguf"), kind, mmproj=True))
    return out


@pytest.fixture(scope="module")
def pairs(vl_dir, tmp_path_factory):
    return convert_pairs(vl_dir, KINDS, tmp_path_factory, "tiny-vl")


@pytest.fixture(scope="module")
def moe_pairs(moe_dir, tmp_path_factory):
    return convert_pairs(moe_dir, MOE_KINDS, tmp_path_factory, "tiny-vl-moe")


@pytest.fixture(scope="module")
def reference(vl_dir, tmp_path_factory):
    from transformers import Qwen3VLForConditionalGeneration
    return transformers_reference(vl_dir, Qwen3VLForConditionalGeneration, tmp_path_factory)


@pytest.fixture(scope="module")
def moe_reference(moe_dir, tmp_path_factory):
    from transformers import Qwen3VLMoeForConditionalGeneration
    return transformers_reference(moe_dir, Qwen3VLMoeForConditionalGeneration, tmp_path_factory)


def transformers_reference(vl_dir: str, model_cls, tmp_path_factory):
    """transformers on the checkpoint in float32: (prompt ids, greedy ids, the rendered prompt text)."""
    from transformers.image_utils import load_image

    ref_dir = tmp_path_factory.mktemp("reference-processor")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copyfile(os.path.join(vl_dir, name), ref_dir / name)
    write_preprocessor_config(str(ref_dir), MIN_PIXELS, MAX_PIXELS)
    proc = reference_processor(str(ref_dir))
    text = proc.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=[load_image(p["image_url"]["url"]) for p in MESSAGES[0]["content"][1:3]], return_tensors="pt")
    model = model_cls.from_pretrained(vl_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist(), text


def mtmd_greedy(pair, rendered: str) -> dict:
    """llama.cpp's mtmd on the pair: the rendered prompt with its marker for each image (mtmd writes the vision
    start/end itself), the two images as Pillow's RGB pixels; {"prompt", "tokens", "top2"} (bench/peer_mtmd.py)."""
    from PIL import Image

    pm = mtmd_peer_module()
    pixels = []
    for data in MTMD_IMAGES:
        im = Image.open(io.BytesIO(data)).convert("RGB")
        pixels.append((im.width, im.height, im.tobytes()))
    with pm.MtmdPeer(*pair, n_threads=2, n_ctx=512) as peer:
        text = rendered.replace("<|vision_start|><|image_pad|><|vision_end|>", peer.marker)
        assert text.count(peer.marker) == len(MTMD_IMAGES)
        return peer.greedy(text, pixels, N_TOKENS)


def served_tokens(port: int, messages=MESSAGES) -> tuple[list[int], list[int], str, list[list[float]]]:
    """(prompt ids, completion ids, text, per step the top two logprobs) of a greedy streamed answer to
    messages, through the openai client."""
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300) as c:
        stream = c.chat.completions.create(model="tiny", messages=messages, stream=True, max_tokens=N_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True},
                                           logprobs=True, top_logprobs=2,
                                           stream_options={"include_usage": True, "include_tokens": True})
        text, tokens, usage, top2 = [], None, None, []
        for chunk in stream:
            if chunk.object == "chat.completion.tokens":
                tokens = chunk.model_extra["tokens"]
            elif chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                if chunk.choices[0].logprobs is not None:
                    top2.extend([t.logprob for t in e.top_logprobs] for e in chunk.choices[0].logprobs.content or [])
            if chunk.usage is not None:
                usage = chunk.usage
    assert tokens is not None and usage is not None
    n = usage.prompt_tokens
    assert usage.completion_tokens == N_TOKENS and len(tokens) == n + N_TOKENS
    assert len(top2) == N_TOKENS
    return tokens[:n], tokens[n:], "".join(text), top2


@pytest.mark.parametrize("kind", KINDS)
def test_pair_prompt_ids_and_greedy_tokens_against_transformers(kind, pairs, reference, cli_server):
    check_pair(pairs[kind], kind, reference, cli_server)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_pair_prompt_ids_and_greedy_tokens_against_transformers(kind, moe_pairs, moe_reference, cli_server):
    check_pair(moe_pairs[kind], kind, moe_reference, cli_server)


def check_pair(pair, kind, reference, cli_server):
    text_path, mmproj_path = pair
    ref_prompt, ref_greedy, rendered = reference
    proc, port = cli_server(text_path, "--mmproj", mmproj_path, "--ctx", "512",
                            "--image-max-pixels", str(MAX_PIXELS), "--prefill-chunk", "64")
    prompt, ours, _, our_top2 = served_tokens(port)
    assert prompt == ref_prompt  # the image pads (54 + 32), vision start/end and the text, as transformers'
    assert prompt.count(151655) == 54 + 32
    if kind == "f32":
        assert ours == ref_greedy
        return
    prompt, ours, _, our_top2 = served_tokens(port, MTMD_MESSAGES)
    theirs = mtmd_greedy(pair, rendered)  # the same template text: only the pictures differ from MESSAGES
    assert theirs["prompt"] == prompt  # llama.cpp's own tokenization and image token counts
    assert prompt.count(151655) == 54 + 32
    assert_same_or_near_tie(ours, our_top2, theirs["tokens"], theirs["top2"], TIE_MARGIN[kind])


def assert_same_or_near_tie(ours, our_top2, theirs, their_top2, margin: float):
    """Identical greedy tokens, or identical up to a step where both engines' two best logits are within
    margin of each other (past a divergence the contexts differ, so nothing after it is compared)."""
    if ours == theirs:
        return
    k = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    ours_gap = our_top2[k][0] - our_top2[k][1]
    theirs_gap = their_top2[k][0] - their_top2[k][1]
    assert ours_gap <= margin and theirs_gap <= margin, (k, ours, theirs, our_top2[k], their_top2[k])


def test_the_one_mmproj_beside_the_model_is_used_and_logged(pairs):
    text_path, mmproj_path = pairs["q8_0"]
    p = subprocess.run(CLI + ["--model", text_path, "--prompt", "Hi", "--max-tokens", "2", "--temperature", "0"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"vision projector: {mmproj_path}" in p.stderr


def test_props_and_show_report_vision_from_the_pair(pairs, cli_server):
    text_path, _ = pairs["f16"]
    proc, port = cli_server(text_path, "--ctx", "256")  # the mmproj beside it
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/props", timeout=60) as r:
        props = json.load(r)
    assert props["modalities"]["vision"] is True
    assert props["image"]["min_pixels"] == MIN_PIXELS and props["image"]["pixels_per_token"] == 32 * 32
    show = ollama.Client(host=f"http://127.0.0.1:{port}").show("tiny")
    assert "vision" in show.capabilities and show.details.family == "qwen3vl"


def test_text_model_without_its_projector_serves_text_and_names_mmproj(pairs, tmp_path, cli_server):
    alone = tmp_path / "tiny-vl-f32.gguf"
    os.symlink(pairs["f32"][0], alone)
    p = subprocess.run(CLI + ["--model", str(alone), "--prompt", "Hi", "--max-tokens", "2"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "no vision projector is loaded" in p.stderr and "--mmproj" in p.stderr
    proc, port = cli_server(str(alone), "--ctx", "256")
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120) as c:
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert r.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert e.value.status_code == 400 and "--mmproj" in e.value.body["message"]
    assert e.value.body["param"] == "messages[0].content[1]"
    show = ollama.Client(host=f"http://127.0.0.1:{port}").show("tiny")
    assert "vision" not in show.capabilities


def test_mismatched_pair_is_refused_at_load_with_one_line_and_status_2(pairs, tmp_path):
    other = build_qwen3_vl(str(tmp_path / "other"), hidden=96, layers=1, head_dim=32, heads=2, kv_heads=1,
                           vision_depth=2, deepstack=(0,), seed=5)
    wrong = convert_hf(other, str(tmp_path / "mmproj-other.gguf"), "f16", mmproj=True)
    p = subprocess.run(CLI + ["--model", pairs["f16"][0], "--mmproj", wrong, "--prompt", "Hi"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("kestrel-appliance: error: ")]
    assert len(errors) == 1 and "width 96" in errors[0] and "64" in errors[0] and "not a pair" in errors[0], p.stderr
