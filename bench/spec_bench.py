"""Speculative decoding from the prompt against plain decoding and against llama.cpp, same file, same run.

Three tasks, greedy, up to --tokens tokens each: rewrite (repeat a ~500-token passage), json (extract fields of
that passage as JSON), chat (a free question). Per task and model, decode tok/s (first token to last) of:
ours with n-gram drafts (the default, --spec ngram), ours plain (--spec none), llama.cpp plain (its decode with
an argmax, as gguf_bench times it), llama-cpp-python's Llama.generate (its Python sampler per token) plain and
with its LlamaPromptLookupDecoding (10-token drafts), and our acceptance (accepted / drafted). Ratios are against
llama.cpp plain. Median of --runs runs, engines interleaved.
Our greedy tokens with and without drafts are checked to be identical (the run stops if not).

Models: SmolLM2-135M-Instruct Q4_1 (real weights: its answers quote the prompt) and the Qwen3-1.7B-shaped random
Q4_0 file of gguf_bench.py (random weights never quote anything: that row shows what drafting costs when it
does not pay).

    python bench/spec_bench.py [--models smollm2,q4_0] [--threads 2] [--tokens 128] [--runs 3]

With --draft-model (self, tiny or a path; e.g. `--models q4_0 --draft-model self,tiny`) the table is instead
ours with that draft model vs ours n-gram vs ours plain vs llama.cpp plain. No draft model of the 1.7B file's
tokenizer agrees with its random weights, so the two built-in drafts bracket a real one: `self` is the file
drafting for itself (acceptance forced by construction, but each drafted token costs a full target step: the
speed a perfect draft as expensive as the target gives), `tiny` a 64-wide random Qwen3 with the Qwen tokenizer
(drafting costs almost nothing, and almost nothing is accepted: what a useless draft model costs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from appliance.engine.generate import GenerationRequest
from appliance.engine.load import LoadOptions, load_model
from appliance.engine.sampling import SamplingParams
from appliance.engine.speculative import SpecOptions
from appliance.native import kernels
from tests.support.gguf_files import peer_module

PASSAGE = """The lighthouse on the northern cape was built in 1874 from granite quarried two miles inland. Its keeper,
Thomas Hale, climbed the one hundred and twelve steps of the spiral stair every evening at dusk. He trimmed the wick,
polished the great Fresnel lens until it shone, and wound the clockwork that turned the light once every thirty
seconds. Ships far out at sea watched for its beam, and the fishermen of the village of Carrow said that as long as
the old man kept the lamp burning, no boat would be lost on the rocks below the cape.

In the winter of 1891 a storm blew for nine days without pause. The supply boat could not land, and Hale rationed
the lamp oil, burning it only from dusk until midnight and again in the last two hours before dawn. On the seventh
night the schooner Margaret Ellis, carrying coal from Newcastle, lost her foremast and drifted toward the cape. Hale
saw her lights at two in the morning, lit every lamp he had, and rang the fog bell by hand until sunrise. The
schooner's crew heard the bell, dropped both anchors in time, and rode out the storm a quarter of a mile from the
rocks. When the weather cleared, the crew rowed ashore and climbed the stair to thank him.

The lighthouse was automated in 1962 and the keeper's cottage became a small museum. Visitors can still see the
brass bell, the logbook in which Hale recorded the storm, and the lens, which now turns under an electric motor.
"""
TASKS = {
    "rewrite": f"Repeat the following text exactly, word for word, without any comment:\n\n{PASSAGE}",
    "json": f"{PASSAGE}\nExtract from the text above, as a JSON object with the keys \"keeper\", \"built\", "
            "\"steps\", \"storm_days\" and \"ship\", the values quoted from the text.",
    "chat": "Write a short story about a robot who learns to paint.",
}


def model_files(names: list[str]) -> dict[str, str]:
    import gguf_bench  # the same files gguf_bench measures (a sibling file; bench/ is not a package)
    return dict(gguf_bench.bench_file(n) for n in names)


def ours_run(loaded, ids: list[int], n: int) -> tuple[float, list[int], int, int]:
    fin = list(loaded.engine.generate(GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=n)))[-1]
    t = fin.timings
    steps = sum(t.decode_ms) / 1000.0
    return (len(fin.token_ids) - 1) / steps if steps > 0 else 0.0, fin.token_ids, t.draft_n, t.draft_n_accepted


def bench_model(label: str, path: str, threads: int, n: int, runs: int) -> list[dict]:
    kernels.configure_threads(threads)
    spec = load_model(path, LoadOptions(context_length=2048, threads=threads))
    plain = load_model(path, LoadOptions(context_length=2048, threads=threads, spec=SpecOptions("none")))
    for m in (spec, plain):
        m.engine.warm_up()
    peer = peer_module()
    rows = []
    with peer.LlamaCppPeer(path, n_threads=threads, n_ctx=2048) as lp, \
            peer.LlamaCppPeer(path, n_threads=threads, n_ctx=2048, prompt_lookup=10) as lk:
        for task, text in TASKS.items():
            ids = spec.tokenizer.encode(spec.chat_template.render([{"role": "user", "content": text}],
                                                                  add_generation_prompt=True))
            r: dict = {"model": label, "task": task, "prompt": len(ids), "ours_spec": [], "ours_plain": [],
                       "llama": [], "llama_generate": [], "llama_lookup": [], "drafted": 0, "accepted": 0}
            for _ in range(runs):
                tok_s, tokens, drafted, accepted = ours_run(spec, ids, n)
                r["ours_spec"].append(tok_s)
                r["drafted"], r["accepted"], r["tokens"] = drafted, accepted, len(tokens)
                tok_s_plain, tokens_plain, _, _ = ours_run(plain, ids, n)
                r["ours_plain"].append(tok_s_plain)
                if tokens != tokens_plain:
                    raise SystemExit(f"{label}/{task}: drafts changed the greedy tokens")
                for key, p, direct in (("llama", lp, True), ("llama_generate", lp, False),
                                       ("llama_lookup", lk, False)):
                    g = p.generate(ids, len(tokens), direct=direct)
                    r[key].append((len(g["tokens"]) - 1) / g["decode_s"] if g["decode_s"] > 0 else 0.0)
            for key in ("ours_spec", "ours_plain", "llama", "llama_generate", "llama_lookup"):
                r[key] = statistics.median(r[key])
            rows.append(r)
            print_row(r)
    return rows


def draft_path(name: str) -> str:
    """A --draft-model entry: "tiny" (a tiny random Qwen3 directory, built once), else a path."""
    if name != "tiny":
        return name
    import gguf_bench

    from tests.support.tiny_models import build_qwen3
    out = os.path.join(gguf_bench.CACHE, "tiny-qwen3-draft")
    return out if os.path.exists(os.path.join(out, "config.json")) else build_qwen3(out, seed=11)


def engine_arm(loaded, spec: SpecOptions, draft=None):
    """An engine of its own (caches, drafting) over the loaded model's weights: one load serves every arm."""
    from types import SimpleNamespace

    from appliance.engine.draft_model import DraftModel
    from appliance.engine.generate import Engine
    from appliance.engine.load import decoder_of
    e = loaded.engine
    draft_model = None if draft is None else DraftModel(decoder_of(draft), e.context_length, e.cache.dtype,
                                                         e.prefill_chunk, loaded.config.vocab_size)
    engine = Engine(loaded.model, loaded.tokenizer, e.eos_ids, e.context_length, e.prefill_chunk, e.cache.dtype,
                    spec=spec, draft_model=draft_model)
    engine.warm_up()
    return SimpleNamespace(engine=engine)


def bench_draft_model(label: str, path: str, drafts: list[str], tasks: list[str], threads: int, n: int,
                      runs: int) -> None:
    kernels.configure_threads(threads)
    target = load_model(path, LoadOptions(context_length=2048, threads=threads, spec=SpecOptions("none")))
    target.engine.warm_up()
    arms = {"plain": target, "ngram": engine_arm(target, SpecOptions())}
    for d in drafts:  # "self": the target's own weights draft (no second copy)
        dm = target.model if d == "self" else load_model(draft_path(d), LoadOptions(context_length=64)).model
        arms[d] = engine_arm(target, SpecOptions(), dm)
    with peer_module().LlamaCppPeer(path, n_threads=threads, n_ctx=2048) as lp:
        for task in tasks:
            ids = target.tokenizer.encode(target.chat_template.render(
                [{"role": "user", "content": TASKS[task]}], add_generation_prompt=True))
            speed: dict[str, list[float]] = {k: [] for k in [*arms, "llama"]}
            accepted: dict[str, str] = {}
            for _ in range(runs):
                want = None
                for k, m in arms.items():
                    tok_s, tokens, drafted, acc = ours_run(m, ids, n)
                    if want is not None and tokens != want:
                        raise SystemExit(f"{label}/{task}/{k}: drafts changed the greedy tokens")
                    want = tokens
                    speed[k].append(tok_s)
                    accepted[k] = f"{acc}/{drafted}"
                g = lp.generate(ids, len(want or []), direct=True)
                speed["llama"].append((len(g["tokens"]) - 1) / g["decode_s"] if g["decode_s"] > 0 else 0.0)
            med = {k: statistics.median(v) for k, v in speed.items()}
            base = med["llama"] or 1e-9
            cells = " | ".join(f"{med[k]:.1f} ({med[k] / base:.2f}x) {accepted.get(k, '')}".strip()
                               for k in [*drafts, "ngram", "plain"])
            print(f"| {label} | {task} | {len(ids)} | {len(want or [])} | {cells} | {med['llama']:.1f} |", flush=True)


QWEN35_SHAPES = {  # --qwen35 entries: random Qwen3.5 checkpoints with an MTP head (tests/support/tiny_models.py)
    "tiny": dict(seed=16, layers=8, interval=4, linear_dims=(16, 16)),  # tests/support/qwen3_5_gguf.py's shape (llama.cpp runs it)
    # the 2B's widths (hidden 2048, 8/2 heads of 256, 16/16 linear heads of 128, MLP 6144, tied), 8 of its 24
    # layers (6 linear, 2 full) and the Qwen3 tokenizer's 152K vocabulary (the 2B has 248K)
    "2b8": dict(seed=6, hidden=2048, layers=8, interval=4, heads=8, kv_heads=2, head_dim=256, intermediate=6144,
                linear_dims=(128, 128), linear_heads=(16, 16), tie=True, init_std=0.02),
}


def qwen35_checkpoint(name: str, bigram: bool) -> str:
    """A random Qwen3.5 with an MTP head (built once under the bench cache); bigram: its copy whose head is right
    by construction (tiny_models.make_bigram_with_mtp: acceptance forced, so the row shows what accepted MTP
    drafts buy at this shape)."""
    import gguf_bench

    from tests.support.tiny_models import build_qwen3_5, make_bigram_with_mtp
    out = os.path.join(gguf_bench.CACHE, f"random-qwen3_5-{name}-mtp")
    if not os.path.exists(os.path.join(out, "config.json")):
        build_qwen3_5(out + ".tmp", mtp=True, **QWEN35_SHAPES[name])
        os.rename(out + ".tmp", out)
    if not bigram:
        return out
    dst = out + "-bigram"
    if not os.path.exists(os.path.join(dst, "config.json")):
        make_bigram_with_mtp(out, dst + ".tmp")
        os.rename(dst + ".tmp", dst)
    return dst


def bench_qwen35(name: str, bigram: bool, tasks: list[str], threads: int, n: int, runs: int) -> None:
    """Ours with MTP drafts vs n-gram drafts vs plain on one Qwen3.5 checkpoint (one load, three engines), and
    llama.cpp plain on its converter's f16 GGUF of the same checkpoint."""
    from tests.support.llama_convert import convert_hf
    kernels.configure_threads(threads)
    path = qwen35_checkpoint(name, bigram)
    gguf_path = path + ".f16.gguf"
    if not os.path.exists(gguf_path):
        convert_hf(path, gguf_path + ".tmp", "f16", timeout=1800)
        os.rename(gguf_path + ".tmp", gguf_path)
    target = load_model(path, LoadOptions(context_length=2048, threads=threads, spec=SpecOptions("none")))
    target.engine.warm_up()
    from appliance.engine.qwen3_5_mtp import mtp_drafter
    target.model.mtp_on = True  # only the MTP arm's cache has the head's slot (its forwards alone feed the head)
    arms = {"mtp": engine_arm(target, SpecOptions("mtp"))}
    arms["mtp"].engine.drafter = mtp_drafter(target.model, arms["mtp"].engine.cache)
    target.model.mtp_on = False
    arms.update(ngram=engine_arm(target, SpecOptions("ngram")), plain=target)
    label = f"qwen3.5-{name}{'-bigram' if bigram else ''}"
    with peer_module().LlamaCppPeer(gguf_path, n_threads=threads, n_ctx=2048) as lp:
        for task in tasks:
            ids = target.tokenizer.encode(target.chat_template.render(
                [{"role": "user", "content": TASKS[task]}], add_generation_prompt=True))
            speed: dict[str, list[float]] = {k: [] for k in [*arms, "llama"]}
            accepted: dict[str, str] = {}
            want: list[int] = []
            for _ in range(runs):
                for k, m in arms.items():
                    tok_s, tokens, drafted, acc = ours_run(m, ids, n)
                    if k != "mtp" and tokens != want:
                        raise SystemExit(f"{label}/{task}/{k}: drafts changed the greedy tokens")
                    want = tokens
                    speed[k].append(tok_s)
                    accepted[k] = f"{acc}/{drafted}"
                g = lp.generate(ids, len(want), direct=True)
                speed["llama"].append((len(g["tokens"]) - 1) / g["decode_s"] if g["decode_s"] > 0 else 0.0)
            med = {k: statistics.median(v) for k, v in speed.items()}
            base = med["llama"] or 1e-9
            cells = " | ".join(f"{med[k]:.1f} ({med[k] / base:.2f}x) {accepted.get(k, '')}".strip() for k in arms)
            print(f"| {label} | {task} | {len(ids)} | {len(want)} | {cells} | {med['llama']:.1f} | "
                  f"load {os.getloadavg()[0]:.1f} |", flush=True)


def print_row(r: dict) -> None:
    base = r["llama"] or 1e-9
    acc = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "0/0"
    print(f"| {r['model']} | {r['task']} | {r['prompt']} | {r['tokens']} | {r['ours_spec']:.1f} "
          f"({r['ours_spec'] / base:.2f}x) | {r['ours_plain']:.1f} ({r['ours_plain'] / base:.2f}x) | "
          f"{r['llama']:.1f} | {r['llama_generate']:.1f} | {r['llama_lookup']:.1f} ({r['llama_lookup'] / base:.2f}x) | "
          f"{acc} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,q4_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--draft-model", default="", help="comma list of drafts: self, tiny, or paths")
    ap.add_argument("--tasks", default=",".join(TASKS), help="with --draft-model or --qwen35: comma list of tasks")
    ap.add_argument("--qwen35", default="", help="comma list of Qwen3.5 checkpoints with an MTP head: tiny, 2b8, "
                                                 "each optionally +bigram (its head right by construction)")
    a = ap.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f}; {a.threads} threads; greedy, up to {a.tokens} tokens")
    if a.qwen35:
        print("| model | task | prompt tokens | tokens | ours MTP tok/s, accepted/drafted | ours n-gram | ours plain "
              "| llama.cpp plain tok/s | load |")
        print("|---|---|---|---|---|---|---|---|---|")
        for entry in a.qwen35.split(","):
            name, _, variant = entry.partition("+")
            bench_qwen35(name, variant == "bigram", a.tasks.split(","), a.threads, a.tokens, a.runs)
        return 0
    if a.draft_model:
        drafts = a.draft_model.split(",")
        print("| model | task | prompt tokens | tokens | " + " | ".join(f"ours draft {d} tok/s, accepted/drafted"
                                                                       for d in drafts)
              + " | ours n-gram | ours plain | llama.cpp tok/s |")
        print("|---|---|---|---|" + "---|" * (len(drafts) + 3))
        for label, path in model_files(a.models.split(",")).items():
            bench_draft_model(label, path, drafts, a.tasks.split(","), a.threads, a.tokens, a.runs)
        return 0
    print("| model | task | prompt tokens | tokens | ours n-gram tok/s | ours plain tok/s | llama.cpp tok/s | "
          "llama-cpp-python generate tok/s | its prompt lookup tok/s | accepted/drafted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, path in model_files(a.models.split(",")).items():
        bench_model(label, path, a.threads, a.tokens, a.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
