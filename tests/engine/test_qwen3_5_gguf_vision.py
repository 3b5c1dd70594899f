"""llama.cpp's Qwen3.5 pairs (a qwen35 / qwen35moe text GGUF + its mmproj GGUF, both made by llama.cpp's own
converter from a tiny random Qwen3.5 with a vision tower): the prompt ids of a message with two non-square
images equal transformers' processor's, and 12 greedy tokens equal transformers' float32 generate on the same
bf16 checkpoint, for F32 and F16 pairs, dense and MoE (max |logprob diff| over the prompt printed); on the F16
pairs llama.cpp's own mtmd (bench/peer_mtmd.py: it serves Qwen3.5's projector) gives the same prompt ids and the
same greedy tokens, or the same up to a near-tie in both engines. The one
mmproj*.gguf beside the text file is used; a text file alone serves text and its refused images name --mmproj; a
Qwen3-VL projector (DeepStack layers) with a Qwen3.5 text file is refused by the CLI with one line, status 2."""
import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from appliance.engine.generate import GenerationRequest
from appliance.engine.image_processing import decode_image
from appliance.engine.load import MismatchedPair, load_model
from appliance.engine.qwen3_5_vl import Qwen35VLModel
from appliance.engine.qwen3_vl import expand_image_pads
from appliance.engine.sampling import SamplingParams
from tests.support.gguf_files import mtmd_peer_module
from tests.support.llama_convert import convert_hf
from tests.support.qwen3_5_gguf import build_pairs
from tests.support.tiny_vl import cached_qwen3_vl, image_bytes, reference_processor

IMAGE_PAD = 151655
KINDS = ("f32", "f16")
MAX_PIXELS = 32 * 32 * 64  # the checkpoint's preprocessor bound; --image-max-pixels gives the pair the same
# max |log p(ours) - log p(transformers)| over the prompt, per pair type. Not ~1e-3 for F32 as from the Hugging Face
# directory (1.1e-3 on the dense checkpoint): the converter computes 1 + w of the zero-centred norms and
# -exp(A_log) in the checkpoint's bf16, so even the F32 file holds them rounded (measured: 2.3e-3 dense F32, 2.1e-3
# dense F16, 8.5e-3 MoE F32, 3.4e-3 MoE F16: the MoE's routing amplifies small differences either way).
LOGPROB_BOUND = {("dense", "f32"): 4e-3, ("moe", "f32"): 2e-2, ("dense", "f16"): 5e-3, ("moe", "f16"): 2e-2}
N_TOKENS = 12
MESSAGES = [{"role": "user", "content": [
    {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": "a"}},
    {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": "b"}},
    {"type": "text", "text": "please."}]}]
CLI = [sys.executable, "-m", "appliance"]


@pytest.fixture(scope="module", params=["dense", "moe"])
def pairs(request, tmp_path_factory):
    return build_pairs(str(tmp_path_factory.mktemp(f"q35vl-{request.param}")), request.param == "moe", KINDS)


@pytest.fixture(scope="module")
def images():
    return [decode_image(image_bytes(w, h, "PNG", seed=w + h)) for w, h in ((300, 200), (150, 250))]


@pytest.fixture(scope="module")
def reference(pairs, images):
    """transformers in float32 on the checkpoint: (inputs, logits over the prompt, greedy ids)."""
    from transformers import AutoModelForImageTextToText

    proc = reference_processor(pairs["hf"])
    text = proc.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=images, return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(pairs["hf"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(**inputs).logits[0].numpy()  # (T, vocab)
        out = model.generate(**inputs, max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS, do_sample=False)
    return inputs, logits, out[0, inputs["input_ids"].shape[1]:].tolist()


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("kind", KINDS)
def test_pair_prompt_ids_logprobs_and_greedy_tokens_equal_transformers(kind, pairs, images, reference):
    text_path, mmproj_path = pairs[kind]
    inputs, want_logits, want_tokens = reference
    loaded = load_model(text_path, mmproj=mmproj_path, context_length=512, prefill_chunk=16,
                        image_max_pixels=MAX_PIXELS)
    assert loaded.multimodal and isinstance(loaded.model, Qwen35VLModel)
    ids = loaded.tokenizer.encode(loaded.chat_template.render(MESSAGES, add_generation_prompt=True))
    patches = [loaded.model.image_processor.preprocess(im) for im in images]
    ids = expand_image_pads(ids, IMAGE_PAD, [p.num_tokens for p in patches])
    assert ids == inputs["input_ids"][0].tolist()
    assert [list(p.grid_thw) for p in patches] == inputs["image_grid_thw"].tolist()
    m, cache = loaded.model, loaded.model.new_cache(512)
    m.prepare_images(cache, ids, patches)
    got = np.concatenate([m.forward(np.array(ids[s:s + 16]), cache, "all") for s in range(0, len(ids), 16)])
    diff = np.abs(log_softmax(got.astype(np.float64)) - log_softmax(want_logits.astype(np.float64))).max()
    print(f"{os.path.basename(text_path)}: max |logprob diff| over the prompt {diff:.2e}")
    assert diff <= LOGPROB_BOUND["moe" if "-moe-" in text_path else "dense", kind], diff
    events = list(loaded.engine.generate(GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=N_TOKENS,
                                                           ignore_eos=True, images=tuple(patches))))
    assert not set(want_tokens) & loaded.eos_ids
    assert events[-1].token_ids == want_tokens


TIE_MARGIN = 0.05  # nats between the two best logits, in both engines, for a divergence to count as a near-tie


def test_f16_pair_equals_llama_cpps_mtmd(pairs):
    """mtmd resizes its own way: pictures whose size no resize changes (multiples of 32 inside the bounds), so both
    engines start from the same pixels (Pillow's RGB decode handed to mtmd)."""
    from PIL import Image

    text_path, mmproj_path = pairs["f16"]
    pictures = [Image.open(io.BytesIO(image_bytes(w, h, "PNG", seed=w))).convert("RGB")
                for w, h in ((288, 192), (128, 256))]  # 54 and 32 image tokens
    loaded = load_model(text_path, context_length=512, image_max_pixels=MAX_PIXELS)
    rendered = loaded.chat_template.render(MESSAGES, add_generation_prompt=True)
    patches = [loaded.model.image_processor.preprocess(im) for im in pictures]
    ids = expand_image_pads(loaded.tokenizer.encode(rendered), IMAGE_PAD, [p.num_tokens for p in patches])
    events = list(loaded.engine.generate(GenerationRequest(ids, SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
                                                           max_tokens=N_TOKENS, ignore_eos=True,
                                                           images=tuple(patches))))
    ours = events[-1].token_ids
    with mtmd_peer_module().MtmdPeer(text_path, mmproj_path, n_threads=2, n_ctx=512) as peer:
        text = rendered.replace("<|vision_start|><|image_pad|><|vision_end|>", peer.marker)
        theirs = peer.greedy(text, [(im.width, im.height, im.tobytes()) for im in pictures], N_TOKENS)
    assert theirs["prompt"] == ids and ids.count(IMAGE_PAD) == 54 + 32
    print(f"{os.path.basename(text_path)}: greedy tokens {'identical to' if ours == theirs['tokens'] else 'differ from'}"
          f" mtmd's")
    if ours != theirs["tokens"]:
        k = next(i for i, (a, b) in enumerate(zip(ours, theirs["tokens"])) if a != b)
        top = sorted((lp for _, lp in events[k].logprob.top), reverse=True)[:2]
        their_gap = theirs["top2"][k][0] - theirs["top2"][k][1]
        assert top[0] - top[1] <= TIE_MARGIN and their_gap <= TIE_MARGIN, (k, ours, theirs["tokens"])


def test_the_mmproj_beside_the_text_file_is_used(pairs, tmp_path):
    text_path, _ = pairs["f16"]
    assert load_model(text_path, context_length=128).multimodal  # the one mmproj*.gguf in its directory
    alone = tmp_path / os.path.basename(text_path)
    os.symlink(text_path, alone)
    loaded = load_model(str(alone), context_length=128)
    assert not loaded.multimodal and "Qwen3.5" in loaded.images_hint and "--mmproj" in loaded.images_hint
    events = list(loaded.engine.generate(GenerationRequest([9707, 11], SamplingParams(temperature=0.0),
                                                           max_tokens=2)))
    assert events[-1].completion_tokens == 2  # text still served


def test_a_qwen3_vl_projector_is_refused_with_one_line(pairs, tmp_path_factory):
    vl_mmproj = convert_hf(cached_qwen3_vl(tmp_path_factory), str(tmp_path_factory.mktemp("vl") / "mmproj-vl.gguf"),
                           "f16", mmproj=True)  # the same widths (64), two DeepStack layers
    text_path, _ = pairs["f16"]
    with pytest.raises(MismatchedPair, match="DeepStack"):
        load_model(text_path, mmproj=vl_mmproj, context_length=128)
    p = subprocess.run(CLI + ["--model", text_path, "--mmproj", vl_mmproj, "--prompt", "Hi"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("kestrel-appliance: error: ")]
    assert len(errors) == 1 and "2 DeepStack layers" in errors[0] and "not a pair" in errors[0], p.stderr
