"""Qwen3.5 (hybrid Gated DeltaNet) through the CLI server with the official openai client: greedy answers equal
transformers' on the same rendered prompt, streamed and not; a follow-up turn reuses the recurrent-state
snapshot (all of turn 1's prompt but its generation prompt; the share printed) and still answers as transformers
does, also after a cancelled stream; structured output, the Responses API and Ollama's chat work;
a streamed answer about two non-square images (the vision tower in the checkpoint) equals transformers' greedy
answer, its image tokens in usage; a malformed image part is refused with 400."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import urllib.request

import openai
import pytest

from tests.support.hf_reference import greedy_answer
from tests.support.live_server import start_cli_server
from tests.support.tiny_vl import cached_qwen3_5_vl, image_bytes, reference_processor

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}


@contextlib.contextmanager
def cli(model: str, *args: str):
    proc, port = start_cli_server(model, *args)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


@pytest.fixture(scope="module")
def server(tiny_qwen3_5):
    with cli(tiny_qwen3_5, "--ctx", "512", "--prefill-chunk", "16") as url:
        yield url


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_qwen3_5):
    """transformers' greedy continuation (text) of our template's rendering of `messages`."""
    return greedy_answer(tiny_qwen3_5)


def test_greedy_answers_and_a_follow_up_turn(client, reference, tiny_qwen3_5):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_5)
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Name a river in France."}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                           extra_body=NO_THINK)
    assert first.choices[0].message.content == reference(messages, 10)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And a mountain?"}]
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=NO_THINK))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(messages, 10)
    cached, prompt = chunks[-1].usage.prompt_tokens_details.cached_tokens, chunks[-1].usage.prompt_tokens
    # resumed from the snapshot kept before turn 1's generation prompt (`<|im_start|>assistant\n<think>\n\n
    # </think>\n\n`, which turn 2's rendering of the answer does not repeat): all of turn 1's prompt but those tokens
    gen_prompt = len(tokenizer("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"])
    assert cached == first.usage.prompt_tokens - gen_prompt
    print(f"\n2-turn kiosk chat: turn 2 reused {cached} of its {prompt} prompt tokens ({cached / prompt:.0%}); "
          f"turn 1 had {first.usage.prompt_tokens}, its answer 10")
    again = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                           extra_body=NO_THINK)
    assert again.choices[0].message.content == text
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_a_cancelled_stream_leaves_the_next_answer_right(client, reference):
    messages = [{"role": "user", "content": "Count to one hundred."}]
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=400, temperature=0,
                                            stream=True, extra_body=NO_THINK)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away mid-decode: the engine stops within a step
    answer = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                            extra_body=NO_THINK)
    assert answer.choices[0].message.content == reference(messages, 10)


def test_structured_output(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    resp = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "A city as JSON."}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    value = json.loads(resp.choices[0].message.content)
    assert set(value) == {"city"} and isinstance(value["city"], str)


def test_responses_api_and_ollama_chat(client, server):
    """The same conversation through the Responses API and Ollama's /api/chat answers as chat completions does
    (Responses renders the template without the thinking switch, Ollama's think=false sets it off)."""
    messages = [{"role": "user", "content": "Say hello."}]

    def chat(**kw):
        c = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0, **kw)
        return c.choices[0].message.content

    resp = client.responses.create(model="m", input=messages, max_output_tokens=16, temperature=0)
    assert resp.output_text and resp.output_text == chat()
    body = json.dumps({"model": "m", "messages": messages, "stream": False, "think": False,
                       "options": {"temperature": 0, "num_predict": 16}}).encode()
    with urllib.request.urlopen(urllib.request.Request(server + "/api/chat", body), timeout=120) as r:
        reply = json.loads(r.read())
    assert reply["done"] and reply["message"]["content"] == chat(
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})


def image_uri(w: int, h: int, seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(image_bytes(w, h, "PNG", seed=seed)).decode()


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    model = cached_qwen3_5_vl(tmp_path_factory, moe=True)
    with cli(model, "--ctx", "512", "--prefill-chunk", "16") as url:
        yield model, url


def test_two_images_through_the_server_equal_transformers(vl_server):
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    model_dir, url = vl_server
    a, b = image_uri(300, 200, 3), image_uri(150, 250, 4)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": a}},
        {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": b}}]}]
    processor = reference_processor(model_dir)
    pil = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB") for u in (a, b)]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ref = processor(text=[text], images=pil, return_tensors="pt")
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(**ref, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    want = processor.tokenizer.decode(out[0, ref["input_ids"].shape[1]:].tolist())
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        chunks = list(c.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
        assert chunks[-1].usage.prompt_tokens == ref["input_ids"].shape[1]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
        assert e.value.status_code == 400 and "image" in str(e.value).lower()
