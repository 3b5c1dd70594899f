"""Our engine against llama.cpp (llama-cpp-python, built from PyPI into a cached venv, see peer.py) on the same
GGUF files, side by side in one run: decode tok/s (128 tokens) and prefill tok/s (256-token prompt) at 1 and
2 threads, median of >= 3 runs, runs of the two engines interleaved so machine noise hits both alike.

Models: (a) SmolLM2-135M-Instruct Q4_1 (the real file, scripts/fetch_smollm2.py), (b) a Qwen3-1.7B-shaped
random model (hidden 2048, 28 layers, 16/8 heads, head_dim 128, intermediate 6144, vocab 151936, tied) in
Q8_0 and Q4_0 (or any type of SCALE_FIELDS: --models q5_k,iq4_xs), written directly with GGUFWriter (random
blocks with sane scales; speed does not depend on the values) and cached in ~/.cache/kestrel-bench; or (c) the
files people download: `llama-<ftype>` (llama-q4_k_m, llama-q5_k_m, llama-q6_k, llama-iq4_xs, ...) is the same
shape written as random F16 and quantized by llama.cpp's own quantizer (bench/peer.py's quantize), so the file
holds the mix of tensor types llama.cpp picks for that ftype (Q4_K_M: Q4_K + Q6_K for the head and some
attn_v / ffn_down).

Printed per row: both speeds, ours/llama.cpp ratios, and the fraction of the memory-bandwidth limit:
limit tok/s = measured copy bandwidth / weight bytes read per token (every matrix once, the tied embedding
table once as the LM head). Bandwidth is a single-threaded numpy copy of 512 MB, (read + write) / time,
measured again before each row (the machine is shared; the 1-minute load average is printed too).

    python bench/gguf_bench.py [--models smollm2,q8_0,q4_0] [--threads 1,2] [--runs 3]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from appliance.engine.generate import GenerationRequest
from appliance.engine.load import load_model
from appliance.engine.load.gguf import open_gguf
from appliance.engine.sampling import SamplingParams
from appliance.native import kernels
from tests.support.gguf_files import fetch_smollm2, peer_module

CACHE = os.path.expanduser(os.environ.get("KESTREL_BENCH_CACHE", "~/.cache/kestrel-bench"))
QWEN3_1_7B = dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144, vocab=151936)


# -- the random 1.7B-shaped file ------------------------------------------------------------------------------------
# byte offsets of each type's fp16 scales (and mins) in a block, and the std of its random integer part (so the
# weights have a std of ~0.02; the K formats' sub-block scales multiply it by ~30)
SCALE_FIELDS = {"Q8_0": ((0,), 74.0), "Q4_0": ((0,), 4.6), "Q4_1": ((0, 2), 4.6), "Q5_0": ((0,), 9.2),
                "Q5_1": ((0, 2), 9.2), "IQ4_NL": ((0,), 60.0), "Q2_K": ((80, 82), 10.0), "Q3_K": ((108,), 30.0),
                "Q4_K": ((0, 2), 140.0), "Q5_K": ((0, 2), 280.0), "Q6_K": ((208,), 600.0), "IQ4_XS": ((0,), 900.0)}


def random_blocks(rng, qtype_name: str, rows: int, cols: int) -> np.ndarray:
    """(rows, row_bytes) uint8 of random blocks whose fp16 scales give weights of std ~0.02."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    bs, nb = gguf.GGML_QUANT_SIZES[qtype]
    b = np.frombuffer(rng.bytes(rows * (cols // bs) * nb), np.uint8).reshape(rows, cols // bs, nb).copy()
    offsets, spread = SCALE_FIELDS[qtype_name]
    for off in offsets:
        b[..., off:off + 2] = np.frombuffer(np.float16(0.02 / spread).tobytes(), np.uint8)
    return b.reshape(rows, -1)


def write_random_qwen3(path: str, qtype_name: str, shape: dict = QWEN3_1_7B) -> str:
    from appliance.engine.config import Qwen3Config

    s = shape
    cfg = Qwen3Config(model_type="qwen3", vocab_size=s["vocab"], hidden_size=s["hidden"],
                      intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                      rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True)
    D, F = s["hidden"], s["intermediate"]
    plan = [("token_embd.weight", (s["vocab"], D))]
    for i in range(s["layers"]):
        p = f"blk.{i}."
        plan += attention_plan(p, s) + [(p + "ffn_gate.weight", (F, D)), (p + "ffn_up.weight", (F, D)),
                                        (p + "ffn_down.weight", (D, F))]
    plan.append(("output_norm.weight", (D,)))
    return write_random_gguf(path, cfg, plan, qtype_name, f"random-qwen3-1.7b-{qtype_name.lower()}")


def bench_file(name: str) -> tuple[str, str]:
    """(row label, GGUF path) of a --models entry: "smollm2" (the real file) or a quant type of the 1.7B shape."""
    if name == "smollm2":
        return "smollm2-135m-q41", fetch_smollm2()
    if name.startswith(LLAMA_PREFIX):
        f16 = write_random_qwen3(os.path.join(CACHE, "random-qwen3-1.7b-f16.gguf"), "F16")
        return f"qwen3-1.7b-{name}", llama_quantized(f16, name[len(LLAMA_PREFIX):])
    return (f"qwen3-1.7b-{name}",
            write_random_qwen3(os.path.join(CACHE, f"random-qwen3-1.7b-{name}.gguf"), name.upper()))


LLAMA_PREFIX = "llama-"  # --models llama-q4_k_m: the F16 file quantized by llama.cpp to that ftype


def llama_quantized(f16_path: str, ftype: str) -> str:
    """f16_path quantized by llama.cpp's quantizer to `ftype` (a LLAMA_FTYPE_MOSTLY_* name, any case), cached
    beside it."""
    dst = f16_path.replace("-f16.gguf", f"-llama-{ftype.lower()}.gguf")
    if not os.path.exists(dst):
        peer_module().quantize(f16_path, dst + ".tmp", ftype.upper())
        os.replace(dst + ".tmp", dst)
    return dst


def attention_plan(p: str, s: dict) -> list[tuple[str, tuple]]:
    """A Qwen3 layer's norms and attention tensors (GGUF names, numpy shapes)."""
    H, KV, hd, D = s["heads"], s["kv_heads"], s["head_dim"], s["hidden"]
    return [(p + "attn_norm.weight", (D,)), (p + "attn_q.weight", (H * hd, D)), (p + "attn_k.weight", (KV * hd, D)),
            (p + "attn_v.weight", (KV * hd, D)), (p + "attn_output.weight", (D, H * hd)),
            (p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,)), (p + "ffn_norm.weight", (D,))]


def write_random_gguf(path: str, cfg, plan: list[tuple[str, tuple]], qtype_name: str, name: str, moe=None,
                      f32: tuple[str, ...] = ()) -> str:
    """A GGUF of random weights for speed measurements: 1-D tensors are ones, tensors named in `f32` are
    zero-mean random float32 (routers), every other tensor is random blocks of `qtype_name` (2-D or stacked 3-D),
    or random float16 of std 0.02 for "F16" (the input of llama.cpp's quantizer).
    The Qwen tokenizer and chat template go in the metadata, so both engines load it as a chat model."""
    import shutil
    import tempfile

    import gguf

    from appliance.convert.text import GGUF_ARCH, write_hparams, write_tokenizer
    from tests.support import tiny_models

    if os.path.exists(path):
        return path
    os.makedirs(CACHE, exist_ok=True)
    tok_dir = tempfile.mkdtemp(dir=CACHE)
    try:
        tiny_models.write_tokenizer(tok_dir)
        shutil.copyfile(os.path.join(tiny_models.FIXTURES, "qwen3", "chat_template.jinja"),
                        os.path.join(tok_dir, "chat_template.jinja"))
        w = gguf.GGUFWriter(path + ".tmp", GGUF_ARCH.get(cfg.model_type, cfg.model_type))
        file_type = next(t for t in (f"MOSTLY_{qtype_name}", f"MOSTLY_{qtype_name}_M") if hasattr(gguf.LlamaFileType, t))
        write_hparams(w, cfg, name, file_type, moe)
        write_tokenizer(w, tok_dir, cfg.vocab_size, {"bos_token_id": 151643, "eos_token_id": 151645})
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    bs, nb = gguf.GGML_QUANT_SIZES[qtype]
    for tname, shp in plan:
        if len(shp) == 1 or tname in f32:
            w.add_tensor_info(tname, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
        elif qtype_name == "F16":
            w.add_tensor_info(tname, shp, np.dtype(np.float16), int(np.prod(shp)) * 2)
        else:
            byte_shape = tuple(shp[:-1]) + (shp[-1] // bs * nb,)
            w.add_tensor_info(tname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for tname, shp in plan:
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, np.float32))
        elif tname in f32:  # zero-mean rows: the common offset of random blocks (quants average -0.5) would
            r = rng.standard_normal(shp).astype(np.float32)  # otherwise route every token to the same experts
            w.write_tensor_data(0.05 * (r - r.mean(axis=1, keepdims=True)))
        elif qtype_name == "F16":  # row by row of the leading axis: a bounded float32 temporary
            out = np.empty(shp, np.float16)
            for i in range(shp[0]):
                out[i] = (0.02 * rng.standard_normal(shp[1:], np.float32)).astype(np.float16)
            w.write_tensor_data(out)
        else:
            rows = int(np.prod(shp[:-1]))
            w.write_tensor_data(random_blocks(rng, qtype_name, rows, shp[-1]).reshape(*shp[:-1], -1))
    w.close()
    os.replace(path + ".tmp", path)
    return path


# -- measurements -------------------------------------------------------------------------------------------------
def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes/s of a single-threaded numpy copy, counting read + write."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(reps))
    return 2 * nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes_per_token(path: str) -> int:
    """Bytes of every matrix read for one decoded token (the embedding table counts once when tied)."""
    r = open_gguf(path)
    names = {t.name for t in r.tensors}
    total = 0
    for t in r.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # untied: only one embedding row is read
        total += int(t.n_bytes)
    return total


class Ours:
    def __init__(self, path: str, prompt_len: int, decode: int, prefill_chunk: int | None = None):
        """prefill_chunk: prompt tokens per prefill step (default: the whole prompt in one)."""
        self.lm = load_model(path, context_length=prompt_len + decode + 8, prefill_chunk=prefill_chunk or prompt_len)
        self.lm.engine.reuse_prefix = False  # every run prefills its whole prompt (no reuse of the last one's KV)
        self.path, self.prompt_len, self.decode = path, prompt_len, decode

    def run(self, prompt_len: int, decode: int) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) of one greedy generation over a random prompt."""
        rng = np.random.default_rng(0)
        prompt = [int(t) for t in rng.integers(100, min(self.lm.config.vocab_size, 30000), prompt_len)]
        req = GenerationRequest(prompt, SamplingParams(temperature=0.0), max_tokens=decode, ignore_eos=True)
        fin = list(self.lm.engine.generate(req))[-1]
        return prompt_len / (fin.timings.prefill_ms / 1000.0), fin.timings.tok_s


@contextlib.contextmanager
def side_by_side(ours: Ours, peer, n_threads: int):
    """llama.cpp (bench/peer.py) on ours' file, both engines at n_threads and warmed up (weights paged in, pools
    built); yields the peer."""
    kernels.set_threads(n_threads)
    with peer.LlamaCppPeer(ours.path, n_threads=n_threads, n_ctx=ours.prompt_len + ours.decode + 8) as theirs:
        ours.run(16, 4)
        theirs.bench(16, 4, runs=1, warmup=False)
        yield theirs


def interleaved(ours: Ours, theirs, runs: int, after_ours=None) -> dict[str, list[float]]:
    """Prefill and decode tok/s of `runs` generations of ours' prompt length and decode count by each engine,
    alternating run by run so machine noise hits both alike; after_ours() is called after each of ours."""
    out: dict[str, list[float]] = {"ours_pre": [], "ours_dec": [], "llama_pre": [], "llama_dec": []}
    for _ in range(runs):
        p, d = ours.run(ours.prompt_len, ours.decode)
        out["ours_pre"].append(p)
        out["ours_dec"].append(d)
        if after_ours is not None:
            after_ours()
        r = theirs.bench(ours.prompt_len, ours.decode, runs=1, warmup=False)
        out["llama_pre"].append(r["prefill_tok_s"])
        out["llama_dec"].append(r["decode_tok_s"])
    return out


def bench_model(label: str, path: str, threads: list[int], runs: int, prompt_len: int, decode: int, peer) -> list[dict]:
    rows = []
    wb = weight_bytes_per_token(path)
    ours = Ours(path, prompt_len, decode)
    for n in threads:
        with side_by_side(ours, peer, n) as theirs:
            bandwidth = copy_bandwidth()  # per row: the machine is shared, its load changes
            load = os.getloadavg()[0]
            measured = interleaved(ours, theirs, runs)
        row = dict(model=label, threads=n, **{k: statistics.median(v) for k, v in measured.items()},
                   weight_mb=wb / 1e6, limit=bandwidth / wb, bandwidth=bandwidth, load=load, runs=measured)
        rows.append(row)
        print_row(row, file=sys.stderr)
    return rows


HEADER = (f"{'model':<17}{'thr':>3}{'dec ours':>10}{'dec llama':>10}{'ratio':>7}{'pre ours':>10}{'pre llama':>10}"
          f"{'ratio':>7}{'MB/tok':>8}{'GB/s':>6}{'BW lim':>8}{'ours %':>8}{'llama %':>8}{'load':>6}")


def print_row(r: dict, file=sys.stdout) -> None:
    print(f"{r['model']:<17}{r['threads']:>3}{r['ours_dec']:>10.2f}{r['llama_dec']:>10.2f}"
          f"{r['ours_dec'] / r['llama_dec']:>7.2f}{r['ours_pre']:>10.1f}{r['llama_pre']:>10.1f}"
          f"{r['ours_pre'] / r['llama_pre']:>7.2f}{r['weight_mb']:>8.0f}{r['bandwidth'] / 1e9:>6.1f}{r['limit']:>8.1f}"
          f"{100 * r['ours_dec'] / r['limit']:>7.0f}%{100 * r['llama_dec'] / r['limit']:>7.0f}%{r['load']:>6.1f}",
          file=file, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,q8_0,q4_0")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=128)
    args = ap.parse_args(argv)
    peer = peer_module()
    peer.ensure_peer()
    threads = [int(t) for t in args.threads.split(",")]
    print(f"native library: "
          f"{kernels.available() and kernels.simd_name()}; peer: {peer.PACKAGE}", flush=True)
    rows = []
    for m in args.models.split(","):
        rows += bench_model(*bench_file(m), threads, args.runs, args.prompt, args.decode, peer)
    print(f"\ndecode: {args.decode} tokens; prefill: {args.prompt}-token prompt; median of {args.runs} interleaved runs; "
          "tok/s; ratio = ours / llama.cpp;\nGB/s = numpy copy bandwidth (1 thread, read+write) measured before the row; "
          "BW lim = that / weight bytes per token (tok/s); load = 1-min load average before the row (2 cores, shared)")
    print(HEADER)
    for r in rows:
        print_row(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
