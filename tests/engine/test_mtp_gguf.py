"""The MTP head from llama.cpp's own converter's GGUF (blk.{n_layers}.nextn.*, nextn_predict_layers = 1): the
same drafts as the Hugging Face checkpoint it was converted from (the converter's renames and +1 norm shift
undone), the same drafts as llama.cpp's own MTP context on that file, and greedy tokens identical to plain
decoding, dense and MoE."""
import numpy as np
import pytest

from appliance.engine.generate import GenerationRequest
from appliance.engine.load import LoadOptions, decoder_of, load_model
from appliance.engine.qwen3_5_mtp import MtpDrafter
from appliance.engine.speculative import SpecOptions
from tests.engine.test_speculative import GREEDY, ids_of, run
from tests.support.tiny_models import add_mtp_head

OPTS = dict(context_length=256, prefill_chunk=16)


@pytest.fixture(scope="module", params=["dense", "moe"])
def files(request, tmp_path_factory):
    import shutil

    from tests.support.llama_convert import convert_hf
    src = request.getfixturevalue("qwen3_5_gguf" if request.param == "dense" else "qwen3_5_moe_gguf")["hf"]
    out = tmp_path_factory.mktemp(f"mtp-gguf-{request.param}")
    hf = str(out / "hf")
    shutil.copytree(src, hf)
    add_mtp_head(hf, seed=21)
    return hf, convert_hf(hf, str(out / "mtp-f32.gguf"), "f32")


def drafts(path, ids, k=4):
    m = load_model(path, LoadOptions(**OPTS, spec=SpecOptions("mtp")))
    cache = m.engine.cache
    logits = m.model.forward(np.asarray(ids), cache, "last")
    d = MtpDrafter(decoder_of(m.model), cache)  # a checkpoint with a vision tower: its text decoder's head
    d.extend(list(ids) + [int(np.argmax(logits))])
    return d.propose(k)


def test_gguf_head_drafts_what_the_checkpoint_drafts(files):
    hf, gguf = files
    ids = [9707, 11, 1879, 0, 13, 576, 6722, 315, 9625, 374]
    from appliance.engine.load import load_model as lm
    assert decoder_of(lm(gguf, LoadOptions(**OPTS)).model).mtp is not None
    for n in (3, 10):
        assert drafts(gguf, ids[:n]) == drafts(hf, ids[:n])


def test_gguf_greedy_with_the_head_is_plain(files):
    _, gguf = files
    a = load_model(gguf, LoadOptions(**OPTS, spec=SpecOptions("none")))
    b = load_model(gguf, LoadOptions(**OPTS))
    assert isinstance(b.engine.drafter(), MtpDrafter)
    req = GenerationRequest(ids_of(a, "Tell me a story about a lighthouse."), GREEDY, max_tokens=24, ignore_eos=True)
    _, fa = run(a, req)
    _, fb = run(b, req)
    assert fb.token_ids == fa.token_ids and fb.timings.draft_n > 0


def test_llama_cpp_drafts_what_we_draft(files):
    """llama.cpp's own MTP context (LLAMA_CONTEXT_TYPE_MTP, h_nextn) on the same file, driven as its draft-mtp
    drives it (tests/support/peer_mtp.py): the target's next token and the head's greedy drafts are ours."""
    from tests.support.peer_mtp import llama_drafts
    _, gguf = files
    ids = [9707, 11, 1879, 0, 13, 576, 6722, 315, 9625, 374]
    m = load_model(gguf, LoadOptions(**OPTS, spec=SpecOptions("mtp")))
    for n in (3, 10):
        cache = m.model.new_cache(64)
        nxt = int(np.argmax(m.model.forward(np.asarray(ids[:n]), cache, "last")))
        d = MtpDrafter(m.model, cache)
        d.extend(ids[:n] + [nxt])
        assert [nxt, *d.propose(4)] == llama_drafts(gguf, ids[:n], 4)
