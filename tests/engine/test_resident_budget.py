"""Low-memory mode (--max-resident): the model file's resident pages, read from /proc/self/pagemap while tokens
are generated (checked against /proc/self/smaps' Rss), stay under the budget, and the greedy tokens are those of a run without a budget.

The model is a random Qwen3 built with transformers (hidden 256, 8 layers, MLP 3072; the real Qwen vocabulary)
converted to a Q8_0 GGUF by our converter: 68 MiB, each layer 2.6 MiB, so an 8 MiB budget must stream.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from appliance.engine.generate import GenerationRequest
from appliance.engine.load import load_model
from appliance.engine.resident import ResidentBudgetError, set_max_resident
from appliance.engine.sampling import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20
PROMPT = list(range(1000, 1040))


@pytest.fixture(scope="session")
def layered_gguf(tmp_path_factory) -> str:
    from appliance import convert
    from tests.support.tiny_models import build_qwen3

    d = tmp_path_factory.mktemp("layered")
    build_qwen3(str(d / "hf"), hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, intermediate=3072)
    out = str(d / "layered-q8_0.gguf")
    assert convert.main([str(d / "hf"), out, "--type", "q8_0"]) == 0
    return out


@pytest.fixture(scope="module")
def reference(layered_gguf):
    """The model without a budget (x8 rearranged copies, nothing released) and its greedy tokens."""
    lm = load_model(layered_gguf, context_length=128)
    lm.engine.warm_up()
    tokens = generate(lm)
    assert len(set(tokens)) > 4  # a real sequence, not one token repeated
    return lm, tokens


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def generate(lm, n: int = 16) -> list[int]:
    req = GenerationRequest(PROMPT, SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True)
    return list(lm.engine.generate(req))[-1].token_ids


class PeakResident:
    """The model mappings' resident bytes sampled right before each layer's pages are released (the most a
    layer adds) and, all along, by a thread (the output head's slabs, the middle of a layer)."""

    def __init__(self, streaming):
        self.streaming, self.samples = streaming, []
        orig = streaming.layer_done

        def layer_done(i: int) -> None:
            self.samples.append(streaming.resident_bytes())
            orig(i)

        streaming.layer_done = layer_done
        self.running = True
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while self.running:
            self.samples.append(self.streaming.resident_bytes())
            time.sleep(0.001)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


@pytest.mark.parametrize("budget_mib", [8, 20])
def test_resident_weights_stay_under_the_budget_with_the_same_greedy_tokens(layered_gguf, reference, budget_mib):
    expected = reference[1]
    lm = load_model(layered_gguf, context_length=128, max_resident_mib=budget_mib)  # LoadOptions.max_resident_mib
    plan = lm.model.layer_streaming.plan
    assert 0 <= plan.pinned_layers < 8 and not plan.head_pinned and plan.peak <= budget_mib * MiB
    anon = rss_anon()
    lm.engine.warm_up()
    streaming = lm.model.layer_streaming
    with PeakResident(streaming) as peak:
        tokens = generate(lm)
    assert tokens == expected
    from appliance.engine.page_release import mapping_rss
    copies = sum(w._x8.nbytes for w in streaming.copies if w._x8 is not None)  # the pinned layers' x8 copies
    assert copies == sum(w.nbytes for w in streaming.copies) and (copies > 0) == (plan.pinned_layers > 0)
    # pagemap (what resident_bytes reads) agrees with smaps' Rss of the mapping
    assert streaming.resident_bytes() - copies == mapping_rss(*streaming.mapping_views)
    assert len(peak.samples) > 16 * 8 and min(peak.samples) >= 0
    assert max(peak.samples) <= budget_mib * MiB, (max(peak.samples) / MiB, plan)
    file_bytes = os.path.getsize(layered_gguf)
    assert file_bytes > 3 * budget_mib * MiB
    # the streamed layers were read from the mapping, not from copies: anonymous memory grew by the pinned
    # layers' x8 copies and little else (the x8 copies of a run without a budget would add ~60 MiB)
    assert rss_anon() - anon < copies + 12 * MiB, ((rss_anon() - anon) / MiB, copies / MiB)
    # the pinned layers stay resident: a larger budget keeps more
    if plan.pinned_layers:
        assert max(peak.samples) >= plan.pinned_layers * 2 * MiB


def test_numpy_path_streams_the_same_tokens(layered_gguf, monkeypatch):
    """Without the native library (its numpy twins) the layers are released the same way."""
    from appliance.native import kernels

    monkeypatch.setattr(kernels, "available", lambda: False)
    expected = generate(load_model(layered_gguf, context_length=128), 2)
    lm = load_model(layered_gguf, context_length=128)
    set_max_resident(lm.model, 8 * MiB)
    with PeakResident(lm.model.layer_streaming) as peak:
        tokens = generate(lm, 2)
    assert tokens == expected
    assert 0 <= max(peak.samples) <= 8 * MiB


def test_budget_below_one_layer_and_moe_models_are_refused(reference, tiny_qwen3_moe):
    lm = reference[0]
    with pytest.raises(ResidentBudgetError, match="below what one layer needs"):
        set_max_resident(lm.model, 1 * MiB)
    assert lm.model.layer_streaming is None and generate(lm) == reference[1]  # a refusal changes nothing
    with pytest.raises(ResidentBudgetError, match="--moe-release-pages"):
        set_max_resident(load_model(tiny_qwen3_moe).model, 64 * MiB)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_cli_one_shot_answers_as_without_a_budget_and_refuses_a_tiny_one(layered_gguf, reference):
    lm = reference[0]
    ids = lm.tokenizer.encode(lm.chat_template.render([{"role": "user", "content": "Hello"}],
                                                       add_generation_prompt=True))
    req = GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=6)
    expected = "".join(ev.text for ev in lm.engine.generate(req)) + "\n"
    common = ["--model", layered_gguf, "--prompt", "Hello", "--max-tokens", "6", "--temperature", "0"]
    r = run_cli(*common, "--max-resident", "8", "--log-level", "info")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected and expected.strip()
    assert "low-memory mode: 0 of 8 layers resident" in r.stderr
    r = run_cli(*common, "--max-resident", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "kestrel-appliance: error: --max-resident 1: a budget of 1 MiB is below what one layer needs"), r.stderr
    r = run_cli(*common, "--max-resident", "0")
    assert r.returncode == 2 and "--max-resident must be at least 1" in r.stderr
