"""--prompt-cache-dir through the real CLI (`python -m appliance` subprocesses, the openai client): the prefix two
requests share is written after the response, and the first request after a restart reuses it (the CLI's
warm-up keeps it) and answers as a cold server does, for a GGUF (SmolLM2-135M Q4_1), a Hugging Face
directory (the tiny random Qwen3) and a hybrid Qwen3.5 (its file also holds the linear layers' recurrent states). Junk, a FIFO and a dangling link in the directory are skipped with a warning
each; something other than a directory as DIR is a one-line error. The log's `queued` counts the time a request
waited for the engine's after-request work (in process, where the test can hold that work)."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time

import openai
import pytest

from appliance.engine.load import load_model
from appliance.engine.prompt_disk import MAGIC
from tests.support.gguf_files import fetch_smollm2
from tests.support.live_server import LiveServer

SYSTEM = {"role": "system", "content": "You are the house assistant. Entities: " +
          ", ".join(f"light.room_{i} (on)" for i in range(12))}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}
ARGS = ("--ctx", "1024", "--prefill-chunk", "64")


def ask(port, question):
    """(cached tokens, timings.cache_n, text) of one greedy chat completion."""
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120) as c:
        r = c.chat.completions.create(model="m", messages=[SYSTEM, {"role": "user", "content": question}],
                                      max_tokens=6, temperature=0, extra_body=NO_THINK)
    usage, timings = r.usage.prompt_tokens_details, r.model_extra["timings"]
    return usage.cached_tokens, timings["cache_n"], r.choices[0].message.content


def files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".kvc"))


def saved_tokens(path) -> int:
    with open(path, "rb") as f:
        f.seek(len(MAGIC))
        (n,) = struct.unpack("<I", f.read(4))
        return len(json.loads(f.read(n))["tokens"])


def stop(proc) -> str:
    """SIGTERM, exit 0; the rest of its stderr."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    err = proc.stderr.read()
    assert "Traceback" not in err, err
    return err


def wait_for(predicate, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def models(tiny_qwen3_tied, tiny_qwen3_5):
    return {"gguf": fetch_smollm2(), "hf": tiny_qwen3_tied, "qwen3_5": tiny_qwen3_5}


def write_cache(cli_server, model, d):
    proc, port = cli_server(model, "--prompt-cache-dir", str(d), *ARGS)
    ask(port, "Turn on the kitchen light.")
    ask(port, "Is the hall light on?")
    wait_for(lambda: files(d), "the prompt cache file")
    stop(proc)
    (name,) = files(d)
    assert not [n for n in os.listdir(d) if ".tmp" in n]
    return d / name


@pytest.mark.parametrize("kind", ["gguf", "hf", "qwen3_5"])
def test_restart_serves_the_first_request_warm(models, kind, cli_server, tmp_path):
    saved = write_cache(cli_server, models[kind], tmp_path / "cache")
    proc, port = cli_server(models[kind], "--prompt-cache-dir", str(tmp_path / "cache"), *ARGS)
    cached, cache_n, text = ask(port, "What is on in room 3?")
    err = stop(proc)
    assert f"loaded 1 prefix(es) from {tmp_path / 'cache'} ({saved_tokens(saved)} tokens)" in err
    assert cached == cache_n == saved_tokens(saved) > 100  # the system prompt and the user turn's opening
    proc, port = cli_server(models[kind], "--prompt-cache-dir", str(tmp_path / "empty"), *ARGS)
    cold, cold_n, cold_text = ask(port, "What is on in room 3?")  # the same request without a cache on disk
    stop(proc)
    assert cold == cold_n == 0 and cold_text == text


def test_bad_files_in_the_directory_are_skipped_with_a_warning_each(models, cli_server, tmp_path):
    """Next to a valid file: 1 GiB of junk (sparse), a FIFO (opening it would block the start for ever) and a
    dangling link (it used to stop the server with a misleading "No such file or directory")."""
    d = tmp_path / "cache"
    saved = write_cache(cli_server, models["hf"], d)
    with open(d / "junk.kvc", "wb") as f:
        f.write(b"not a cache file at all")
        f.truncate(1 << 30)
    os.mkfifo(d / "fifo.kvc")
    os.symlink(tmp_path / "gone", d / "dangling.kvc")
    proc, port = cli_server(models["hf"], "--prompt-cache-dir", str(d), *ARGS)
    cached, _, _ = ask(port, "What is on in room 3?")
    err = stop(proc)
    assert cached == saved_tokens(saved)
    for name, why in (("junk", "not a prompt cache file"), ("fifo", "a FIFO"),
                      ("dangling", "a dangling symbolic link")):
        assert re.search(rf"WARNING appliance\.prompt_cache: prompt cache: ignoring {re.escape(str(d))}/{name}\.kvc: "
                         rf"{why}\n", err), err
    assert sorted(os.listdir(d)) == sorted([saved.name, "junk.kvc", "fifo.kvc", "dangling.kvc"])  # none deleted


@pytest.mark.parametrize("what", ["file", "dangling link"])
def test_a_prompt_cache_dir_that_is_not_a_directory_is_a_one_line_error(tiny_qwen3_tied, tmp_path, what):
    p = tmp_path / "cache"
    if what == "file":
        p.write_text("x")
    else:
        os.symlink(tmp_path / "gone", p)
    r = subprocess.run([sys.executable, "-m", "appliance", "--model", tiny_qwen3_tied, "--port", "0",
                        "--prompt-cache-dir", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr == f"kestrel-appliance: error: --prompt-cache-dir {p} is not a directory\n"


def test_queued_counts_the_wait_for_the_engines_after_request_work(tiny_qwen3_tied, tmp_path, caplog):
    """The engine's after-request work is held until a second request waits for the engine thread, then 0.3 s
    more: that request's access-log line must say it was queued at least that long (it used to say 0 ms)."""
    def loaded():
        lm = load_model(tiny_qwen3_tied, context_length=512, prompt_cache_dir=str(tmp_path))
        real, lm.engine.after_request = lm.engine.after_request, lambda: (held.set(), release.wait(60), real())
        return lm

    held, release = threading.Event(), threading.Event()
    with caplog.at_level(logging.INFO, logger="appliance.access"), LiveServer(tiny_qwen3_tied, load=loaded) as s:
        ask(s.port, "Turn on the kitchen light.")
        assert held.wait(30)
        second = threading.Thread(target=ask, args=(s.port, "Is the hall light on?"))
        second.start()
        s.wait_for(lambda: s.worker._jobs.qsize() == 1, what="the second job waiting for the engine thread")
        time.sleep(0.3)
        release.set()
        second.join(60)
    queued = [float(m) for m in re.findall(r"queue_ms=([0-9.]+)", caplog.text)]
    assert len(queued) == 2 and queued[1] >= 300, caplog.text
