"""llama.cpp as a peer (llama-cpp-python), in its own cached virtual environment.

Policy: llama-cpp-python is built from its PyPI source distribution (no prebuilt wheels are reachable), which
takes 6-10 minutes on a 2-core machine, so the venv is built once into $KESTREL_PEER_VENV (default
~/.cache/kestrel-bench/llama-venv) under a file lock and reused by the benchmarks and the tests. The build uses
the instruction sets this host can execute (bench/peer_isa.py: GGML_NATIVE unless the CPU lists AMX that does
not run, as in virtual machines; then explicit GGML_* flags); a build with other flags than the default native
one gets its own venv (llama-venv-<flags hash>), so switching never rebuilds over a good cached venv. It never
enters the project's own environment: the peer runs as a child process (`python bench/peer.py serve` with
the venv's interpreter, stdlib + llama_cpp only) that answers one JSON request per line on stdin.

    with LlamaCppPeer("model.gguf", n_threads=2) as p:
        p.tokenize("text"); p.greedy(prompt_ids, 8); p.logits(ids); p.bench(256, 128)

and `quantize(src, dst, "Q4_K_M")` runs llama.cpp's own quantizer, so tests and benches use files made the way the
published ones are.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_isa  # a sibling file; bench/ is not a package

PACKAGE = "llama-cpp-python==0.3.36"
BUILD_OPTS = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
NATIVE_CMAKE_ARGS = f"{peer_isa.NATIVE_ARGS} {BUILD_OPTS}"  # what the default venv path was always built with


@functools.lru_cache(maxsize=1)
def cmake_args() -> str:
    return peer_isa.cmake_args(BUILD_OPTS)


def venv_dir() -> str:
    if os.environ.get("KESTREL_PEER_VENV"):
        return os.path.expanduser(os.environ["KESTREL_PEER_VENV"])
    base = os.path.expanduser("~/.cache/kestrel-bench/llama-venv")
    if cmake_args() == NATIVE_CMAKE_ARGS:
        return base
    return f"{base}-{hashlib.sha256(cmake_args().encode()).hexdigest()[:10]}"


def peer_python() -> str:
    return os.path.join(venv_dir(), "bin", "python")


def peer_ready() -> bool:
    py = peer_python()
    return os.path.exists(py) and subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def ensure_peer(log=sys.stderr) -> str:
    """The peer venv's python, building the venv first if needed (once, under a lock)."""
    import fcntl

    if peer_ready():
        return peer_python()
    os.makedirs(os.path.dirname(venv_dir()), exist_ok=True)
    with open(venv_dir() + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if peer_ready():  # someone else built it while we waited
            return peer_python()
        print(f"peer: building {PACKAGE} into {venv_dir()} with {cmake_args()} (6-10 minutes, once)", file=log,
              flush=True)
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "venv", "--clear", venv_dir()], check=True)
        env = dict(os.environ, CMAKE_ARGS=cmake_args(), CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
        with open(venv_dir() + ".build.log", "w") as out:
            r = subprocess.run([peer_python(), "-m", "pip", "install", "--no-cache-dir", PACKAGE],
                               env=env, stdout=out, stderr=subprocess.STDOUT)
        if r.returncode != 0 or not peer_ready():
            raise RuntimeError(f"building {PACKAGE} failed; see {venv_dir()}.build.log")
        print(f"peer: built in {time.time() - t0:.0f} s", file=log, flush=True)
    return peer_python()


def call_child(proc: subprocess.Popen, who: str, req: dict):
    """One request to a peer child process (one JSON object per line each way): its "result", or RuntimeError
    with the child's "error" or its exit status. Shared by LlamaCppPeer and peer_mtmd.MtmdPeer."""
    proc.stdin.write(json.dumps(req) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{who} exited (status {proc.wait()}) on {req['op']}")
    resp = json.loads(line)
    if "error" in resp:
        raise RuntimeError(f"{who}: {resp['error']}")
    return resp["result"]


class LlamaCppPeer:
    """One llama.cpp model in a child process of the peer venv."""

    def __init__(self, model_path: str, n_threads: int = 2, n_ctx: int = 1024, embedding: bool = False,
                 prompt_lookup: int = 0, flash_attn: bool = False):
        """embedding: llama.cpp's embedding mode (the file's pooling_type, normalised pooled vectors: `embed`);
        prompt_lookup: drafts of that many tokens from llama-cpp-python's LlamaPromptLookupDecoding (`generate`);
        flash_attn: llama.cpp's flash attention (llama-server's `-fa auto` turns it on for the CPU;
        llama-cpp-python's default, kept here, leaves it off)."""
        self.proc = subprocess.Popen([ensure_peer(), os.path.abspath(__file__), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.info = self._call(op="load", path=os.path.abspath(model_path), n_threads=n_threads, n_ctx=n_ctx,
                               embedding=embedding, prompt_lookup=prompt_lookup, flash_attn=flash_attn)

    def _call(self, **req):
        return call_child(self.proc, "llama.cpp peer", req)

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self._call(op="tokenize", text=text, special=special)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """n greedy tokens after prompt (argmax of llama.cpp's logits, no sampler chain)."""
        return self._call(op="greedy", tokens=prompt, n=n)

    def generate(self, tokens: list[int], n: int, direct: bool = False) -> dict:
        """Greedy tokens through llama-cpp-python's Llama.generate (with the prompt-lookup draft when the peer was
        opened with prompt_lookup=N), or `direct`ly (eval + argmax, as `bench` times llama.cpp), and the time from
        the first token to the last."""
        return self._call(op="generate", tokens=list(map(int, tokens)), n=n, direct=direct)

    def logits(self, tokens: list[int]) -> list[list[float]]:
        """Logits (T, vocab) at every position of tokens."""
        return self._call(op="logits", tokens=tokens)

    def turn(self, tokens: list[int], reuse: bool, decode: int = 0) -> dict:
        """Time to the first token of `tokens` (ttft_ms), reusing the KV prefix of the context or not (cached)."""
        return self._call(op="turn", tokens=list(tokens), reuse=reuse, decode=decode)

    def bench(self, prompt_len: int, decode: int, runs: int = 3, warmup: bool = True) -> dict:
        """Median prefill and decode tok/s over runs (after one untimed warm-up run unless warmup=False)."""
        return self._call(op="bench", prompt_len=prompt_len, decode=decode, runs=runs, warmup=warmup)

    def embed(self, texts: list[str]) -> dict:
        """Embedding mode: each text tokenized as llama.cpp does (its add_bos/add_eos), decoded, pooled and
        L2-normalised; {"vectors": [[...], ...], "seconds": wall time of the decodes, "tokens": their count}."""
        return self._call(op="embed", texts=list(texts))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def quantize(src: str, dst: str, ftype: str, n_threads: int = 2) -> str:
    """llama.cpp's own quantizer (llama_model_quantize, as llama-quantize runs it) on a GGUF file: dst holds the
    tensor types llama.cpp picks for `ftype` (a LLAMA_FTYPE_MOSTLY_* name: Q4_K_M, Q5_0, IQ4_XS, ...)."""
    r = subprocess.run([ensure_peer(), os.path.abspath(__file__), "quantize", os.path.abspath(src),
                        os.path.abspath(dst), ftype, str(n_threads)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp quantize {ftype} failed ({r.returncode}): {r.stderr[-2000:]}")
    return dst


# -- the child side: runs in the peer venv, imports only the stdlib and llama_cpp ---------------------------------
def _quantize(src: str, dst: str, ftype: str, n_threads: int) -> int:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = n_threads
    return llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))


def _serve() -> None:
    import statistics

    import llama_cpp
    import numpy as np

    llm = None

    def last_logits():  # the logits of the last evaluated token, read straight from the context
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))

    def argmax_last():
        return int(np.argmax(last_logits()))

    def handle(req):
        nonlocal llm
        op = req["op"]
        if op == "load":
            emb = bool(req.get("embedding"))
            batch = req["n_ctx"] if emb else 512  # embeddings: a whole input in one micro-batch
            draft = None
            if req.get("prompt_lookup"):  # llama-cpp-python's own speculative decoding from the prompt
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
                draft = LlamaPromptLookupDecoding(num_pred_tokens=int(req["prompt_lookup"]))
            llm = llama_cpp.Llama(req["path"], n_ctx=req["n_ctx"], n_threads=req["n_threads"],
                                  n_threads_batch=req["n_threads"], n_batch=batch, n_ubatch=batch,
                                  logits_all=draft is not None,  # (its scores buffer is sized by this flag)
                                  embedding=emb, draft_model=draft, flash_attn=bool(req.get("flash_attn")),
                                  verbose=False)
            return {"version": llama_cpp.__version__, "n_vocab": llm.n_vocab()}
        if op == "embed":  # one text per decode (llama-server's /v1/embeddings with one slot does the same)
            vectors, n_tokens, t0 = [], 0, time.perf_counter()
            for text in req["texts"]:
                vec, count = llm.embed(text, normalize=True, return_count=True)
                vectors.append([float(x) for x in vec])
                n_tokens += count
            return {"vectors": vectors, "seconds": time.perf_counter() - t0, "tokens": n_tokens}
        if op == "tokenize":
            return llm.tokenize(req["text"].encode("utf-8"), add_bos=False, special=req["special"])
        if op == "greedy":
            llm.reset()
            llm.eval(req["tokens"])
            out = []
            for _ in range(req["n"]):
                out.append(argmax_last())
                llm.eval([out[-1]])
            return out
        if op == "generate":  # greedy through Llama.generate (its draft model, if any): tokens and decode time
            llm.reset()
            out, t_first = [], None
            if req.get("direct"):  # llama.cpp's decode without llama-cpp-python's sampler: eval + argmax
                llm.eval(req["tokens"])
                out.append(argmax_last())
                t_first = time.perf_counter()
                while len(out) < req["n"] and out[-1] != llm.token_eos():
                    llm.eval([out[-1]])
                    out.append(argmax_last())
                return {"tokens": out, "decode_s": time.perf_counter() - t_first}
            for tok in llm.generate(req["tokens"], top_k=1, temp=0.0, reset=True):
                if t_first is None:
                    t_first = time.perf_counter()
                out.append(int(tok))
                if len(out) >= req["n"] or tok == llm.token_eos():
                    break
            return {"tokens": out, "decode_s": time.perf_counter() - t_first}
        if op == "logits":
            rows = []
            llm.reset()
            for t in req["tokens"]:  # one token at a time: logits_all is off, the last row is kept
                llm.eval([t])
                rows.append(last_logits().astype(np.float32).tolist())
            return rows
        if op == "bench":
            rng = np.random.default_rng(0)
            prompt = [int(t) for t in rng.integers(100, min(llm.n_vocab(), 30000), req["prompt_len"])]
            prefill, decode = [], []
            warm = 1 if req["warmup"] else 0
            for run in range(req["runs"] + warm):  # a warm-up run pages the weights in
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(prompt)
                t1 = time.perf_counter()
                tok = argmax_last()
                t2 = time.perf_counter()
                for _ in range(req["decode"]):
                    llm.eval([tok])
                    tok = argmax_last()
                t3 = time.perf_counter()
                if run >= warm:
                    prefill.append(req["prompt_len"] / (t1 - t0))
                    decode.append(req["decode"] / (t3 - t2))
            return {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
                    "prefill_runs": prefill, "decode_runs": decode}
        if op == "turn":  # time to the first token of a prompt, reusing the context's KV prefix or not
            tokens = [int(t) for t in req["tokens"]]
            if not req["reuse"]:
                llm.reset()
            t0 = time.perf_counter()
            n = 0
            if req["reuse"]:  # what llama-cpp-python's generate() and llama.cpp's server cache_prompt do
                for a, b in zip(llm._input_ids[:llm.n_tokens].tolist(), tokens[:-1]):
                    if a != b:
                        break
                    n += 1
                llm.n_tokens = n  # eval() drops the KV past n before it runs the rest
            llm.eval(tokens[n:])
            tok = argmax_last()
            ms = (time.perf_counter() - t0) * 1000.0
            for _ in range(req.get("decode", 0)):  # the answer joins the context, as in a conversation
                llm.eval([tok])
                tok = argmax_last()
            return {"ttft_ms": ms, "cached": n}
        raise ValueError(f"unknown op {op!r}")

    for line in sys.stdin:
        req = json.loads(line)
        try:
            resp = {"result": handle(req)}
        except Exception as e:  # report to the parent instead of dying
            resp = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(resp) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        _serve()
    elif sys.argv[1:] == ["build"]:
        print(ensure_peer())
    elif sys.argv[1:2] == ["quantize"] and len(sys.argv) == 6:
        sys.exit(1 if _quantize(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])) else 0)
    else:
        print("usage: python bench/peer.py build | serve | quantize SRC DST FTYPE THREADS", file=sys.stderr)
        sys.exit(2)
