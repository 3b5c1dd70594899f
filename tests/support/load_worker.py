"""A worker process of the loader's fuzz tier (tests/support/file_fuzz.py): reads one JSON line per file from
stdin ({"path", "kind"}), loads it the way the CLI does, and writes one JSON line per file to stdout:
{"outcome": "loaded" | "refused" | "error", "message", "status", "growth", "seconds"}.

- kind "model": load_model (validation, weights, tokenizer, template, engine), then one forward of one token
  through the layers the load chose (the C decoder when the library is there), logits of shape (vocab,). A
  refusal is a ModelLoadError whose message is one line; its status is the CLI's exit status (2 for a refused
  file). Anything else raised is an "error" with the traceback (a bug: the CLI would print a traceback).
- kind "container": the shared GGUF container reader only (gguf_file.GGUFFile: what an mmproj file goes
  through); a refusal is a one-line ValueError.
- growth: the peak resident set during the load minus the resident set before it (VmHWM after resetting it
  through /proc/self/clear_refs), so a header that makes the loader allocate for what it claims instead of
  what the file holds shows up.
"""
from __future__ import annotations

import gc
import json
import logging
import sys
import time
import traceback


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def load_one(path: str, kind: str) -> dict:
    import numpy as np

    from appliance.cli import load_failure_status
    from appliance.engine.load import ModelLoadError, load_model
    from appliance.engine.load.gguf_file import GGUFFile

    reset_peak()
    before = rss_kb("VmRSS")
    t0 = time.monotonic()
    out: dict
    try:
        if kind == "container":
            f = GGUFFile(path)
            out = {"outcome": "loaded", "message": f"{len(f.tensors)} tensors"}
            del f
        else:
            lm = load_model(path, context_length=64, cache_ram_mb=1, prompt_cache_dir=None)
            logits = lm.model.forward(np.array([0]), lm.model.new_cache(4))
            if logits.shape != (lm.config.vocab_size,):
                raise AssertionError(f"logits of shape {logits.shape} for a vocabulary of {lm.config.vocab_size}")
            out = {"outcome": "loaded", "message": type(lm.model.runner).__name__}
            del lm, logits
    except ModelLoadError as e:
        out = {"outcome": "refused", "message": str(e), "status": load_failure_status(e)}
    except ValueError as e:
        if kind == "container":
            out = {"outcome": "refused", "message": str(e), "status": 2}
        else:
            out = {"outcome": "error", "message": traceback.format_exc()}
    except BaseException:  # noqa: B036  (a bug, reported with its traceback)
        out = {"outcome": "error", "message": traceback.format_exc()}
    out["seconds"] = time.monotonic() - t0
    out["growth"] = max(0, rss_kb("VmHWM") - before) * 1024
    if out["outcome"] == "loaded":
        gc.collect(1)  # a model's reference cycles, if any, before the next file's baseline (a full collection: ~30 ms)
    return out


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    from appliance.native import kernels
    if kernels.available():
        kernels.configure_threads(1)  # the fuzz tier runs two workers on a shared machine
    sys.stdout.write(json.dumps({"ready": True, "native": kernels.available()}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.write(json.dumps(load_one(req["path"], req["kind"])) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
