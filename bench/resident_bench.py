"""Low-memory mode (--max-resident): resident memory and decode speed against the budget, on the random
Qwen3-1.7B-shaped Q8_0 GGUF of gguf_bench.py (1.8 GB), each budget in a fresh process.

    python bench/resident_bench.py [--budgets none,all,1024,512,256,128,64] [--decode 32] [--threads 2]

Columns: the plan (layers kept resident), the most resident weight bytes seen at any layer boundary (the
file mapping's pages from /proc/self/pagemap + the pinned layers' x8 copies), the process's RSS after the
run and its anonymous part, its peak RSS (VmHWM, including loading), decode tok/s and
the ratio to the run without a budget measured in the same invocation ("none": x8 rearranged copies, nothing
released; "all": a budget the whole file fits in). The file stays in the page cache
here, so a released page comes back as a minor fault; on a board whose RAM is smaller than the file, each
streamed layer is read from storage again at every token (bounded by its read speed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from appliance.engine.generate import GenerationRequest
from appliance.engine.load import load_model
from appliance.engine.sampling import SamplingParams
from appliance.native import kernels
path, budget, decode, threads = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
kernels.set_threads(threads)
mib = None if budget == "none" else (os.path.getsize(path) >> 20) + 64 if budget == "all" else int(budget)
lm = load_model(path, context_length=256, max_resident_mib=mib)
hwm_load = int(dict(l.split(":", 1) for l in open("/proc/self/status"))["VmHWM"].split()[0]) * 1024
lm.engine.warm_up()
st = lm.model.layer_streaming
req = GenerationRequest(list(range(1000, 1016)), SamplingParams(temperature=0.0), max_tokens=decode, ignore_eos=True)
fin = list(lm.engine.generate(req))[-1]  # timed without the probe below (reading pagemap costs ~ms per layer)
peak = [0]
if st is not None:  # the resident bytes at every layer boundary of a short second generation
    orig = st.layer_done
    def layer_done(i):
        peak[0] = max(peak[0], st.resident_bytes())
        orig(i)
    st.layer_done = layer_done
    list(lm.engine.generate(GenerationRequest(list(range(2000, 2016)), SamplingParams(temperature=0.0),
                                              max_tokens=4, ignore_eos=True)))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
kb = lambda k: int(status[k].split()[0]) * 1024
print(json.dumps({"budget": budget, "budget_mib": mib, "tok_s": fin.timings.tok_s, "peak_mapped": peak[0],
                  "pinned": st.plan.pinned_layers if st else None, "layers": len(lm.model.layers),
                  "vmhwm": kb("VmHWM"), "hwm_load": hwm_load, "vmrss": kb("VmRSS"), "rss_anon": kb("RssAnon"), "load": os.getloadavg()[0]}))
"""


def main(argv=None) -> int:
    from bench.gguf_bench import CACHE, write_random_qwen3

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="none,all,1024,512,256,128,64")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    path = write_random_qwen3(os.path.join(CACHE, "random-qwen3-1.7b-q8_0.gguf"), "Q8_0")
    print(f"{os.path.basename(path)}: {os.path.getsize(path) / 2**20:.0f} MiB; {args.decode} decoded tokens, "
          f"{args.threads} threads; CPU {os.cpu_count()} cores", flush=True)
    rows = []
    for b in args.budgets.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD, ROOT, path, b, str(args.decode), str(args.threads)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(f"budget {b}: failed: {out.stderr.strip().splitlines()[-1]}", flush=True)
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    base = next((r["tok_s"] for r in rows if r["budget"] == "none"), None)
    print(f"{'budget MiB':>10} {'resident layers':>16} {'peak weights MiB':>17} {'RSS MiB':>8} {'anon MiB':>9} "
          f"{'peak RSS MiB':>13} {'decode tok/s':>13} {'vs none':>8} {'load':>5}")
    for r in rows:
        label = r["budget"] if r["budget_mib"] is None else str(r["budget_mib"])
        pinned = "-" if r["pinned"] is None else f"{r['pinned']}/{r['layers']}"
        mapped = "-" if r["pinned"] is None else f"{r['peak_mapped'] / 2**20:.0f}"
        ratio = f"{r['tok_s'] / base:.2f}x" if base else "-"
        print(f"{label:>10} {pinned:>16} {mapped:>17} {r['vmrss'] / 2**20:>8.0f} {r['rss_anon'] / 2**20:>9.0f} "
              f"{r['vmhwm'] / 2**20:>13.0f} {r['tok_s']:>13.2f} {ratio:>8} {r['load']:>5.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
