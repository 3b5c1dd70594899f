"""llama.cpp's multimodal runtime (tools/mtmd, through llama-cpp-python's mtmd_cpp bindings) as a peer: a text
GGUF + mmproj GGUF pair, a prompt with images, greedy tokens.

Policy: like bench/peer.py (whose venv it reuses), the peer runs as a child process of the peer venv's
interpreter (stdlib + llama_cpp + numpy only) answering one JSON request per line on stdin. Images cross as raw
RGB pixels decoded by the parent (Pillow), handed to mtmd_bitmap_init: both engines start from the same pixels,
so no JPEG/PNG decoder difference enters a comparison. The prompt is text with mtmd's media marker where each
image goes (mtmd adds <|vision_start|>/<|vision_end|> around an image itself); the child evaluates it with
mtmd_helper_eval_chunks (M-RoPE positions and all) and decodes greedily with explicit positions from the
n_past that helper returns, as llama.cpp's mtmd-cli does.

    with MtmdPeer("text.gguf", "mmproj.gguf") as p:
        r = p.greedy(prompt_text, [(w, h, rgb_bytes), ...], 12)  # {"prompt", "tokens", "top2", "encode_s"}
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer  # a sibling file; bench/ is not a package

IMAGE_PAD = 151655  # <|image_pad|>: how an image chunk's tokens are reported in "prompt"


class MtmdPeer:
    """One llama.cpp text model + projector in a child process of the peer venv."""

    def __init__(self, model_path: str, mmproj_path: str, n_threads: int = 2, n_ctx: int = 1024):
        self.proc = subprocess.Popen([peer.ensure_peer(), os.path.abspath(__file__), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.info = self._call(op="load", path=os.path.abspath(model_path), mmproj=os.path.abspath(mmproj_path),
                               n_threads=n_threads, n_ctx=n_ctx)

    def _call(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp mtmd peer exited (status {self.proc.wait()}) on {req['op']}")
        resp = json.loads(line)
        if "error" in resp:
            raise RuntimeError(f"llama.cpp mtmd peer: {resp['error']}")
        return resp["result"]

    @property
    def marker(self) -> str:
        return self.info["marker"]

    def greedy(self, text: str, images: list[tuple[int, int, bytes]], n: int) -> dict:
        """n greedy tokens after `text` (the media marker once per image) with images as (width, height, RGB
        bytes): {"prompt": the evaluated ids (an image as its count of IMAGE_PAD), "tokens": greedy ids, "top2":
        per step the two largest logits, "encode_s": seconds of the whole prompt's evaluation, "rss_mb"}."""
        imgs = [{"w": w, "h": h, "rgb": base64.b64encode(data).decode()} for w, h, data in images]
        return self._call(op="greedy", text=text, images=imgs, n=n)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- the child side: runs in the peer venv, imports only the stdlib, numpy and llama_cpp --------------------------
def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _serve() -> None:
    import ctypes

    import llama_cpp
    import numpy as np
    from llama_cpp import mtmd_cpp as mt

    state: dict = {}

    def load(req):
        llm = llama_cpp.Llama(req["path"], n_ctx=req["n_ctx"], n_threads=req["n_threads"],
                              n_threads_batch=req["n_threads"], n_batch=512, n_ubatch=512, verbose=False)
        params = mt.mtmd_context_params_default()
        params.use_gpu = False
        params.n_threads = req["n_threads"]
        params.print_timings = False
        ctx = mt.mtmd_init_from_file(req["mmproj"].encode(), llm._model.model, params)
        if not ctx:
            raise RuntimeError(f"mtmd_init_from_file failed on {req['mmproj']}")
        if not mt.mtmd_support_vision(ctx):
            raise RuntimeError("the projector has no vision input")
        state.update(llm=llm, ctx=ctx)
        return {"version": llama_cpp.__version__, "marker": mt.mtmd_default_marker().decode(),
                "mrope": bool(mt.mtmd_decode_use_mrope(ctx)), "rss_mb": _rss_mb()}

    def greedy(req):
        llm, ctx = state["llm"], state["ctx"]
        lctx = llm._ctx.ctx
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(lctx), True)
        bitmaps = []
        for im in req["images"]:
            data = base64.b64decode(im["rgb"])
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            bitmaps.append(mt.mtmd_bitmap_init(im["w"], im["h"], buf))
        arr = (mt.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        text = req["text"].encode()
        inp = mt.mtmd_input_text(text, len(text), False, True)  # the template's own specials, no BOS added
        chunks = mt.mtmd_input_chunks_init()
        try:
            rc = mt.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc != 0:
                raise RuntimeError(f"mtmd_tokenize returned {rc}")
            prompt = []
            for i in range(mt.mtmd_input_chunks_size(chunks)):
                chunk = mt.mtmd_input_chunks_get(chunks, i)
                if mt.mtmd_input_chunk_get_type(chunk) == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n_tok = ctypes.c_size_t(0)
                    ptr = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n_tok))
                    prompt.extend(int(ptr[j]) for j in range(n_tok.value))
                else:
                    prompt.extend([IMAGE_PAD] * mt.mtmd_input_chunk_get_n_tokens(chunk))
            n_past = llama_cpp.llama_pos(0)
            t0 = time.perf_counter()
            rc = mt.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, 512, True, ctypes.byref(n_past))
            encode_s = time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"mtmd_helper_eval_chunks returned {rc}")
        finally:
            mt.mtmd_input_chunks_free(chunks)
            for b in bitmaps:
                mt.mtmd_bitmap_free(b)
        n_vocab = llm.n_vocab()
        batch = llama_cpp.llama_batch_init(1, 0, 1)
        tokens, top2, pos = [], [], n_past.value
        t_first = time.perf_counter()
        try:
            for step in range(req["n"]):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(n_vocab,))
                order = np.argsort(logits)[-2:]
                tokens.append(int(order[1]))
                top2.append([float(logits[order[1]]), float(logits[order[0]])])
                if step == req["n"] - 1:
                    break
                batch.n_tokens = 1
                batch.token[0] = tokens[-1]
                batch.pos[0] = pos
                batch.n_seq_id[0] = 1
                batch.seq_id[0][0] = 0
                batch.logits[0] = True
                if llama_cpp.llama_decode(lctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                pos += 1
        finally:
            llama_cpp.llama_batch_free(batch)
        return {"prompt": prompt, "tokens": tokens, "top2": top2, "encode_s": encode_s,
                "decode_s": time.perf_counter() - t_first, "rss_mb": _rss_mb()}

    ops = {"load": load, "greedy": greedy}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            resp = {"result": ops[req["op"]](req)}
        except Exception as e:  # report to the parent instead of dying
            resp = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(resp) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        _serve()
    else:
        print("usage: python bench/peer_mtmd.py serve (the child side; use MtmdPeer)", file=sys.stderr)
        sys.exit(2)
