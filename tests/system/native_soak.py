#!/usr/bin/env python3
"""Decode soak of the native library, for the sanitizer tier (tests/system/test_native_sanitizers.py) and by hand:

    python tests/system/native_soak.py [--model FILE.gguf] [--rounds 6] [--tokens 24]

Loads a real GGUF (default: SmolLM2-135M Q4_1, whose products run on the lazily built x8 copies), warms up and
generates, while other threads do what the server's threads may do at the same moment: a second caller of
the kernels (products outside the pool's job lock), SIMD level switches, and pool resizes between rounds.
Every product is compared with the numpy twin now and then, so a kernel reading the wrong memory shows as a
wrong number even where no sanitizer is loaded. Exits 0 when every round finished; prints one line per round.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import numpy as np

from appliance.native import kernels, twins
from appliance.native.qtypes import QType
from tests.support.ggml_blocks import random_weight


def side_caller(stop: threading.Event, errors: list) -> None:
    """Products from a second thread (the pool's job lock is taken: they run alone) and level switches."""
    rng = np.random.default_rng(7)
    w = random_weight(QType.Q4_0, 40, 256, rng)
    w8 = kernels.repack_x8(QType.Q4_0, w)
    levels = list(range(kernels.simd_max() + 1))
    i = 0
    while not stop.is_set():
        x = rng.standard_normal((3, 256)).astype(np.float32)
        got = kernels.matmul_x8(QType.Q4_0, w8, 40, x)
        want = twins.matmul(QType.Q4_0, w, x)
        if not np.allclose(got, want, rtol=1e-3, atol=1e-3):
            errors.append(f"side product differs from its twin by {np.abs(got - want).max()}")
        kernels.set_simd_level(levels[i % len(levels)])
        i += 1
    kernels.set_simd_level(kernels.simd_max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1, fetched once)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt", default="Tell me a story about a lighthouse.")
    args = ap.parse_args(argv)
    if not kernels.available():
        print(f"native library not loaded: {kernels.load_error}", file=sys.stderr)
        return 2
    if args.model is None:
        from tests.support.gguf_files import fetch_smollm2
        args.model = fetch_smollm2()
    from appliance.engine.generate import GenerationRequest
    from appliance.engine.load import load_model
    from appliance.engine.sampling import SamplingParams

    print(f"library {kernels._lib._name} ({kernels.simd_name()}), model {os.path.basename(args.model)}", flush=True)
    loaded = load_model(args.model, context_length=512, prefill_chunk=32)
    stop, errors = threading.Event(), []
    side = threading.Thread(target=side_caller, args=(stop, errors), daemon=True)
    side.start()
    loaded.engine.warm_up()  # the x8 copies are built here, while the side thread is already running products
    prompt = loaded.tokenizer.encode(args.prompt)
    for r in range(args.rounds):
        kernels.set_threads(1 + r % 3)
        t0 = time.perf_counter()
        req = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=0.8, seed=r),
                                max_tokens=args.tokens, ignore_eos=True)
        n = sum(1 for ev in loaded.engine.generate(req) if not hasattr(ev, "reason"))
        print(f"round {r}: {kernels.get_threads()} threads, {n} tokens in {time.perf_counter() - t0:.2f} s",
              flush=True)
    stop.set()
    side.join(30)
    for e in errors[:5]:
        print(e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
