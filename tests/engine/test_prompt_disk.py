"""PromptDiskCache on its own and inside the engine: the write runs on a writer thread from a snapshot (one in
flight, a byte budget per hour); loading reads a file's header from its first bytes, opens only regular files,
and skips a bad one with a warning naming it. The restart through the real CLI is tests/server/test_server_prompt_cache.py."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest

from appliance.engine.generate import GenerationRequest
from appliance.engine.kv_cache import KVCache
from appliance.engine.load import ModelLoadError, load_model
from appliance.engine.prompt_disk import MAGIC, PrefixWrite, PromptDiskCache
from appliance.engine.sampling import SamplingParams

SYSTEM = "You are the house assistant. Entities: " + ", ".join(f"light.room_{i} (on)" for i in range(12))
GREEDY = SamplingParams(temperature=0.0)


def load(model_dir, cache_dir, **kw):
    return load_model(model_dir, context_length=512, prefill_chunk=32, prompt_cache_dir=str(cache_dir), **kw)


def request(lm, question, system=SYSTEM):
    """One generation as the worker runs it (then its after-request work); the FinishEvent."""
    text = lm.chat_template.render([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                   add_generation_prompt=True, enable_thinking=False)
    events = list(lm.engine.generate(GenerationRequest(lm.tokenizer.encode(text), GREEDY, max_tokens=4,
                                                       ignore_eos=True)))
    lm.engine.after_request()
    return events[-1]


def files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".kvc"))


@pytest.fixture(scope="module")
def warm_dir(tiny_qwen3_tied, tmp_path_factory):
    """A cache directory written by two requests sharing the system prompt."""
    d = tmp_path_factory.mktemp("prompt-cache")
    lm = load(tiny_qwen3_tied, d)
    request(lm, "Turn on the kitchen light.")
    assert lm.engine.disk.wait_idle(30) and files(d) == []  # one request shares nothing yet
    request(lm, "Is the hall light on?")
    assert lm.engine.disk.wait_idle(60) and len(files(d)) == 1
    assert not [n for n in os.listdir(d) if ".tmp" in n]  # written under a temporary name, then renamed
    return d


def test_a_restarted_engine_keeps_the_prefix_through_the_warm_up(tiny_qwen3_tied, warm_dir):
    lm = load(tiny_qwen3_tied, warm_dir)
    adopted = list(lm.engine.cache_tokens)
    lm.engine.warm_up()  # what the CLI does after loading
    assert len(adopted) > 100 and lm.engine.cache_tokens == adopted
    assert request(lm, "What is on in room 3?").timings.cache_n == len(adopted)


def test_the_write_runs_beside_the_engine_from_a_snapshot(tiny_qwen3_tied, tmp_path):
    """A writer held back on purpose: the engine serves other requests meanwhile (a write on the engine thread
    would block the second request's after-request work on `release` and fail the test); a request extending
    the prefix leaves the writer reading the cache, an unrelated one (it overwrites the prefix) hands it a copy
    first, and the bytes written are the cache's when the write began. No second write starts meanwhile."""
    d = tmp_path / "cache"
    lm = load(tiny_qwen3_tied, d)
    disk = lm.engine.disk
    real, release, started, writers = disk._write, threading.Event(), threading.Event(), []

    def held_write(tokens, job):
        writers.append((threading.current_thread(), len(tokens)))
        started.set()
        assert release.wait(60), "the test never released the writer"
        return real(tokens, job)

    disk._write = held_write
    request(lm, "Turn on the kitchen light.")
    request(lm, "Is the hall light on?")  # returns with its prefix's write held back
    assert started.wait(30) and writers[0][0] is not threading.current_thread()
    n, job = writers[0][1], disk._job
    snapshot = lm.engine.cache.copy_prefix(n)  # what the cache holds as the write begins
    assert request(lm, "What is on in room 3?").timings.cache_n >= n
    assert not job.detached  # it extended the prefix: the writer still reads the cache, nothing was copied
    other = "You are a weather bot. Cities: " + ", ".join(f"city_{i}" for i in range(20))
    request(lm, "Hello.", system=other)  # overwrites the prefix's positions
    assert job.detached
    request(lm, "Rain in city_3?", system=other)  # a pair sharing another prefix
    assert not release.is_set() and files(d) == [] and len(writers) == 1  # one write in flight, still held
    release.set()
    assert disk.wait_idle(60) and len(files(d)) == 1 and len(writers) == 1
    (entry,) = PromptDiskCache(str(d), disk.identity, disk.shape, disk.dtype).load_all()
    assert len(entry.tokens) == n
    for got, want in zip(entry.k + entry.v, snapshot[0] + snapshot[1]):
        assert np.array_equal(got, want)
    request(lm, "Snow in city_4?", system=other)  # nothing in flight now: this pair's prefix is saved
    assert disk.wait_idle(60) and len(files(d)) == 2 and len(writers) == 2


def test_a_detached_write_copies_only_what_it_has_not_written(tmp_path):
    cache = filled_cache()
    job = PrefixWrite([*cache.k, *cache.v], 40)
    want = [c.copy() for c in job.chunks]

    class Half:  # a file that has the engine detach the write half way through
        def __init__(self):
            self.parts = []

        def write(self, b):
            self.parts.append(bytes(b))
            if len(self.parts) == len(want) // 2:
                job.detach()
                for a in (*cache.k, *cache.v):
                    a[:] = 0  # the engine overwrites the cache

    f = Half()
    job.write_to(f, hashlib.blake2b())
    assert f.parts == [w.tobytes() for w in want]


def filled_cache(n_tokens=64, shape=(2, 1, 8)):
    L, n_kv, hd = shape
    cache = KVCache(L, n_kv, hd, 128, np.float16)
    rng = np.random.default_rng(0)
    for layer in range(L):
        cache.update(layer, rng.standard_normal((n_kv, n_tokens, hd)), rng.standard_normal((n_kv, n_tokens, hd)))
    cache.commit(n_tokens)
    return cache


def observe_pair(disk, cache, first: int):
    """Two prompts sharing 40 tokens that start at `first` (the cache holds the second one)."""
    shared = list(range(first, first + 40))
    disk.observe(shared + [1], (), cache, shared + [2])
    disk.observe(shared + [2], (), cache, shared + [2])
    assert disk.wait_idle(30)


def test_the_hourly_write_budget(tmp_path, caplog):
    now = [1000.0]
    shape = (2, 1, 8)
    disk = PromptDiskCache(str(tmp_path), "ab" * 16, shape, np.float16, min_tokens=32,
                           write_budget=int(1.5 * 40 * 2 * 2 * 8 * 2), clock=lambda: now[0])  # 1.5 prefixes
    cache = filled_cache(shape=shape)
    with caplog.at_level(logging.WARNING, logger="appliance.prompt_cache"):
        observe_pair(disk, cache, 100)
        assert len(files(tmp_path)) == 1 and not caplog.records
        observe_pair(disk, cache, 200)
        observe_pair(disk, cache, 300)
        assert len(files(tmp_path)) == 1
        assert len(caplog.records) == 1 and "write budget" in caplog.text  # one warning until it frees up
        now[0] += 3600.0  # the first write left the window
        observe_pair(disk, cache, 400)
    assert len(files(tmp_path)) == 2


def test_junk_and_foreign_files_are_judged_by_their_first_bytes(tmp_path, caplog):
    """A 1 GiB junk *.kvc and a foreign file with a 1 GiB payload (both sparse): only their headers are read."""
    with open(tmp_path / "junk.kvc", "wb") as f:
        f.write(b"not a cache file at all")
        f.truncate(1 << 30)
    head = b'{"identity":"another","tokens":[1,2],"shape":[2,1,8],"dtype":"<f2","digest":""}'
    with open(tmp_path / "foreign.kvc", "wb") as f:
        f.write(MAGIC + len(head).to_bytes(4, "little") + head)
        f.truncate(1 << 30)
    disk = PromptDiskCache(str(tmp_path), "ab" * 16, (2, 1, 8), np.float16)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="appliance.prompt_cache"):
            assert disk.load_all() == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    text = caplog.text
    assert f"ignoring {tmp_path / 'junk.kvc'}: not a prompt cache file" in text
    assert f"ignoring {tmp_path / 'foreign.kvc'}: written for another model" in text


def test_only_regular_files_are_opened(tiny_qwen3_tied, warm_dir, tmp_path, caplog):
    """A FIFO (opening it would block forever), a device, a directory and a dangling link, all named *.kvc,
    are skipped unopened, each named in one warning; a link to a valid file is used."""
    (name,) = files(warm_dir)
    os.symlink(warm_dir / name, tmp_path / "linked.kvc")
    os.mkfifo(tmp_path / "fifo.kvc")
    os.symlink("/dev/null", tmp_path / "null.kvc")
    os.mkdir(tmp_path / "dir.kvc")
    os.symlink(tmp_path / "gone", tmp_path / "dangling.kvc")
    result = []
    with caplog.at_level(logging.WARNING, logger="appliance.prompt_cache"):
        t = threading.Thread(target=lambda: result.append(load(tiny_qwen3_tied, tmp_path)), daemon=True)
        t.start()
        t.join(120)
        if t.is_alive():
            pytest.fail("loading hung (a FIFO opened?)")
    assert len(result[0].engine.cache_tokens) > 100  # the linked file
    for n, why in (("fifo", "a FIFO"), ("null", "a character device"), ("dir", "a directory"),
                   ("dangling", "a dangling symbolic link")):
        assert f"ignoring {tmp_path / n}.kvc: {why}" in caplog.text, caplog.text


def test_a_file_as_the_directory_is_a_one_line_load_error(tiny_qwen3_tied, tmp_path):
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    for p in (tmp_path / "file", tmp_path / "dangling"):
        with pytest.raises(ModelLoadError, match=f"^{re.escape(f'--prompt-cache-dir {p}: not a directory')}$"):
            load(tiny_qwen3_tied, p)


def test_stale_temporary_files_of_this_model_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    disk = PromptDiskCache(str(tmp_path), "ab" * 16, (2, 1, 8), np.float16)
    stale = f"{'ab' * 8}-0123.kvc.tmp{dead.pid}"
    kept = [f"{'ab' * 8}-4567.kvc.tmp{os.getpid()}", f"{'cd' * 8}-0123.kvc.tmp{dead.pid}", "notes.txt"]
    for n in [stale] + kept:
        (tmp_path / n).write_bytes(b"x")
    disk.load_all()
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


def damaged(tmp_path, warm_dir, how):
    d = tmp_path / how
    d.mkdir()
    (name,) = files(warm_dir)
    data = (warm_dir / name).read_bytes()
    if how == "corrupted":
        data = data[:-100] + bytes([data[-100] ^ 0x40]) + data[-99:]
    elif how == "truncated":
        data = data[:len(data) // 2]
    elif how == "extended":
        data = data + b"\0"
    (d / name).write_bytes(data)
    return d


@pytest.mark.parametrize("how,reason", [("corrupted", "digest mismatch"), ("truncated", "truncated payload"),
                                        ("extended", "1 bytes past the payload")])
def test_damaged_file_is_ignored_with_a_warning(tiny_qwen3_tied, warm_dir, tmp_path, caplog, how, reason):
    d = damaged(tmp_path, warm_dir, how)
    with caplog.at_level(logging.WARNING, logger="appliance.prompt_cache"):
        lm = load(tiny_qwen3_tied, d)
    assert lm.engine.cache_tokens == []
    (name,) = files(d)
    assert f"ignoring {d / name}: " in caplog.text and reason in caplog.text, caplog.text
    assert request(lm, "What is on in room 3?").timings.cache_n == 0
    assert files(d) == [name]  # not deleted: it is not ours to remove


def test_another_models_file_is_ignored(tiny_qwen3_untied, warm_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="appliance.prompt_cache"):
        lm = load(tiny_qwen3_untied, warm_dir)
    assert lm.engine.cache_tokens == [] and "another model" in caplog.text


def test_float32_cache_does_not_read_float16_files(tiny_qwen3_tied, warm_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="appliance.prompt_cache"):
        lm = load(tiny_qwen3_tied, warm_dir, kv_type="f32")
    assert lm.engine.cache_tokens == [] and "ignoring" in caplog.text
