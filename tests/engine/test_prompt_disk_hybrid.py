"""The disk prompt cache of a hybrid model (Qwen3.5, recurrent_cache.HybridCache): a file holds the full-attention
layers' keys/values and every linear layer's recurrent states (conv and delta state) at the prefix's end
(format 2). A restarted engine resumes from it through the warm-up and decodes the tokens a cold engine does
(with the MTP head drafting too: its KV slot and hidden state are in the file); a damaged file, one whose
states do not fit this model, or a format-1 file under this model's identity is skipped with a warning naming it.
The restart through the real CLI is tests/server/test_server_prompt_cache.py."""
from __future__ import annotations

import hashlib
import json
import logging
import struct

import numpy as np
import pytest

from appliance.engine.prompt_disk import MAGIC, MAGIC_STATES, PromptDiskCache
from tests.engine.test_prompt_disk import files, load, request as ask

QUESTION = "What is on in room 3?"


def write_dir(model, d):
    lm = load(model, d)
    ask(lm, "Turn on the kitchen light.")
    assert lm.engine.disk.wait_idle(30) and files(d) == []
    ask(lm, "Is the hall light on?")
    assert lm.engine.disk.wait_idle(60) and len(files(d)) == 1
    return lm


@pytest.fixture(scope="module")
def warm_dir(tiny_qwen3_5, tmp_path_factory):
    d = tmp_path_factory.mktemp("prompt-cache-qwen3_5")
    write_dir(tiny_qwen3_5, d)
    return d


@pytest.fixture(scope="module")
def cold(tiny_qwen3_5, tmp_path_factory):
    """The tokens a server with nothing on disk answers QUESTION with."""
    event = ask(load(tiny_qwen3_5, tmp_path_factory.mktemp("empty")), QUESTION)
    assert event.timings.cache_n == 0
    return event.token_ids


def header(path):
    data = path.read_bytes()
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    return data[:len(MAGIC)], json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + n]), data[len(MAGIC) + 4 + n:]


def test_the_file_holds_the_kv_and_the_states_at_the_prefix_end(tiny_qwen3_5, tmp_path):
    lm = write_dir(tiny_qwen3_5, tmp_path)
    cache, disk = lm.engine.cache, lm.engine.disk
    (name,) = files(tmp_path)
    magic, head, payload = header(tmp_path / name)
    n = len(head["tokens"])
    assert magic == MAGIC_STATES and n > 100 and n in cache.snapshots  # where the prompts part: a snapshot
    assert [tuple(s) for s in head["states"]] == [a.shape for st in cache.state.values() for a in (st.conv, st.ssm)]
    (entry,) = PromptDiskCache(str(tmp_path), disk.identity, disk.shape, disk.dtype, states=disk.states).load_all()
    k, v = cache.kv.copy_prefix(n)
    assert all(np.array_equal(a, b) for a, b in zip(entry.k + entry.v, k + v))
    (states,) = entry.states.values()
    for got, want in zip(states, cache.snapshots[n]):
        assert np.array_equal(got.conv, want.conv) and np.array_equal(got.ssm, want.ssm)
    assert len(payload) == n * disk.bytes_per_token + disk.state_nbytes


@pytest.mark.parametrize("fixture", ["tiny_qwen3_5", "tiny_qwen3_5_mtp"])
def test_a_restart_resumes_from_the_file_and_answers_as_cold(fixture, request, tmp_path):
    model = request.getfixturevalue(fixture)
    write_dir(model, tmp_path / "cache")
    cold = ask(load(model, tmp_path / "empty"), QUESTION)
    lm = load(model, tmp_path / "cache")
    adopted = list(lm.engine.cache_tokens)
    lm.engine.warm_up()  # what the CLI does after loading: the prefix stays
    assert len(adopted) > 100 and lm.engine.cache_tokens == adopted
    warm = ask(lm, QUESTION)
    assert warm.timings.cache_n == len(adopted) and cold.timings.cache_n == 0
    assert warm.token_ids == cold.token_ids


def rewrite(path, how):
    data = path.read_bytes()
    magic, head, payload = header(path)
    if how == "corrupted state":  # a bit of the last recurrent state (the payload's end)
        data = data[:-3] + bytes([data[-3] ^ 0x40]) + data[-2:]
    elif how == "truncated":  # inside the states
        data = data[:-5]
    elif how == "extended":
        data = data + b"\0" * 4
    else:
        if how == "other state shapes":
            head["states"][1] = [s + 1 for s in head["states"][1]]
        elif how == "format 1":
            magic = MAGIC
        elif how == "format 9":
            magic = MAGIC[:-1] + b"\x09"
        text = json.dumps(head).encode()
        data = magic + struct.pack("<I", len(text)) + text + payload
    path.write_bytes(data)


@pytest.mark.parametrize("how,reason", [
    ("corrupted state", "payload digest mismatch"), ("truncated", "truncated payload"),
    ("extended", "4 bytes past the payload"), ("other state shapes", "unexpected recurrent state shapes"),
    ("format 1", "format 1 (without recurrent states); this model's files are format 2"),
    ("format 9", "unknown format version 9")])
def test_a_bad_state_file_is_skipped_with_a_warning(tiny_qwen3_5, warm_dir, cold, tmp_path, caplog, how, reason):
    (name,) = files(warm_dir)
    (tmp_path / name).write_bytes((warm_dir / name).read_bytes())
    rewrite(tmp_path / name, how)
    with caplog.at_level(logging.WARNING, logger="appliance.prompt_cache"):
        lm = load(tiny_qwen3_5, tmp_path)
    assert f"ignoring {tmp_path / name}: {reason}" in caplog.text, caplog.text
    assert lm.engine.cache_tokens == []
    event = ask(lm, QUESTION)
    assert event.timings.cache_n == 0 and event.token_ids == cold
    assert files(tmp_path) == [name]  # not deleted


def test_a_dense_models_file_is_not_read_as_a_hybrid_ones(tiny_qwen3_tied, tiny_qwen3_5, tmp_path, caplog):
    write_dir(tiny_qwen3_tied, tmp_path)
    with caplog.at_level(logging.WARNING, logger="appliance.prompt_cache"):
        lm = load(tiny_qwen3_5, tmp_path)
    assert lm.engine.cache_tokens == [] and "format 1" in caplog.text, caplog.text


def test_a_detached_write_copies_the_kv_it_has_not_written_never_the_states():
    """The recurrent states a write carries are the cache's snapshots (never written in place): detaching copies
    the keys/values not written yet and keeps the states as they are; the bytes are the KV's then the states'."""
    from appliance.engine.prefix_write import PrefixWrite
    rng = np.random.default_rng(3)
    kv = [rng.standard_normal((2, 16, 4)).astype(np.float16) for _ in range(4)]  # (n_kv, max_len, hd)
    tail = [rng.standard_normal((3, 10)).astype(np.float32), np.zeros((0, 0, 0), np.float32)]
    job = PrefixWrite(kv, 9, tail)
    want = [a[h, :9].tobytes() for a in kv for h in range(2)] + [t.tobytes() for t in tail]
    job.detach()
    assert job.chunks[-2] is tail[0] and job.chunks[-1] is tail[1]
    assert not any(np.shares_memory(c, a) for c in job.chunks[:-2] for a in kv)
    for a in kv:
        a[:] = 0  # the engine overwrites the cache
    parts = []

    class File:
        def write(self, b):
            parts.append(bytes(b))

    job.write_to(File(), hashlib.blake2b())
    assert parts == want
