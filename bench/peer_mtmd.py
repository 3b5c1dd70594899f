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
        b = p.bench(prompt_text, [(w, h, rgb_bytes)], 32)  # encode / prefill / decode seconds apart, "rss_mb"
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
        return peer.call_child(self.proc, "llama.cpp mtmd peer", req)

    @property
    def marker(self) -> str:
        return self.info["marker"]

    def greedy(self, text: str, images: list[tuple[int, int, bytes]], n: int) -> dict:
        """n greedy tokens after `text` (the media marker once per image) with images as (width, height, RGB
        bytes): {"prompt": the evaluated ids (an image as its count of IMAGE_PAD), "tokens": greedy ids, "top2":
        per step the two largest logits, "encode_s": seconds of the whole prompt's evaluation, "rss_mb"}."""
        imgs = [{"w": w, "h": h, "rgb": base64.b64encode(data).decode()} for w, h, data in images]
        return self._call(op="greedy", text=text, images=imgs, n=n)

    def bench(self, text: str, images: list[tuple[int, int, bytes]], n: int) -> dict:
        """The prompt timed in parts: {"encode_s": the images' encode, "prefill_s": the decoder over the prompt
        (text and image embeddings), "decode_s": n greedy steps, "prompt_tokens", "rss_mb" after}."""
        imgs = [{"w": w, "h": h, "rgb": base64.b64encode(data).decode()} for w, h, data in images]
        return self._call(op="bench", text=text, images=imgs, n=n)

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

    def tokenize(req):
        """(chunks, bitmaps, prompt ids with an image as its count of IMAGE_PAD); the caller frees both."""
        ctx = state["ctx"]
        bitmaps = []
        for im in req["images"]:
            data = base64.b64decode(im["rgb"])
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            bitmaps.append(mt.mtmd_bitmap_init(im["w"], im["h"], buf))
        arr = (mt.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        text = req["text"].encode()
        inp = mt.mtmd_input_text(text, len(text), False, True)  # the template's own specials, no BOS added
        chunks = mt.mtmd_input_chunks_init()
        rc = mt.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
        if rc != 0:
            free(chunks, bitmaps)
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
        return chunks, bitmaps, prompt

    def free(chunks, bitmaps):
        mt.mtmd_input_chunks_free(chunks)
        for b in bitmaps:
            mt.mtmd_bitmap_free(b)

    def decode_greedy(n, pos):
        """n greedy tokens from the logits the prompt left, with explicit positions from pos; (tokens, top2)."""
        llm, lctx = state["llm"], state["llm"]._ctx.ctx
        n_vocab = llm.n_vocab()
        batch = llama_cpp.llama_batch_init(1, 0, 1)
        tokens, top2 = [], []
        try:
            for step in range(n):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(n_vocab,))
                order = np.argsort(logits)[-2:]
                tokens.append(int(order[1]))
                top2.append([float(logits[order[1]]), float(logits[order[0]])])
                if step == n - 1:
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
        return tokens, top2

    def greedy(req):
        ctx, lctx = state["ctx"], state["llm"]._ctx.ctx
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(lctx), True)
        chunks, bitmaps, prompt = tokenize(req)
        try:
            n_past = llama_cpp.llama_pos(0)
            t0 = time.perf_counter()
            rc = mt.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, 512, True, ctypes.byref(n_past))
            encode_s = time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"mtmd_helper_eval_chunks returned {rc}")
        finally:
            free(chunks, bitmaps)
        t_first = time.perf_counter()
        tokens, top2 = decode_greedy(req["n"], n_past.value)
        return {"prompt": prompt, "tokens": tokens, "top2": top2, "encode_s": encode_s,
                "decode_s": time.perf_counter() - t_first, "rss_mb": _rss_mb()}

    def bench(req):
        """The prompt chunk by chunk, timed apart: each image's encode (mtmd_encode_chunk), then the prefill
        (text chunks and the image embeddings through the decoder), then n greedy decode steps."""
        ctx, lctx = state["ctx"], state["llm"]._ctx.ctx
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(lctx), True)
        chunks, bitmaps, prompt = tokenize(req)
        encode_s = prefill_s = 0.0
        n_past = llama_cpp.llama_pos(0)
        try:
            n = mt.mtmd_input_chunks_size(chunks)
            for i in range(n):
                chunk = mt.mtmd_input_chunks_get(chunks, i)
                new_past = llama_cpp.llama_pos(0)
                if mt.mtmd_input_chunk_get_type(chunk) == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    t0 = time.perf_counter()
                    rc = mt.mtmd_helper_eval_chunk_single(ctx, lctx, chunk, n_past.value, 0, 512, i == n - 1,
                                                          ctypes.byref(new_past))
                    prefill_s += time.perf_counter() - t0
                else:
                    t0 = time.perf_counter()
                    rc = mt.mtmd_encode_chunk(ctx, chunk)
                    encode_s += time.perf_counter() - t0
                    if rc != 0:
                        raise RuntimeError(f"mtmd_encode_chunk returned {rc}")
                    t0 = time.perf_counter()
                    rc = mt.mtmd_helper_decode_image_chunk(ctx, lctx, chunk, mt.mtmd_get_output_embd(ctx),
                                                           n_past.value, 0, 512, ctypes.byref(new_past),
                                                           mt.mtmd_helper_post_decode_callback(), None)
                    prefill_s += time.perf_counter() - t0
                if rc != 0:
                    raise RuntimeError(f"chunk {i} evaluation returned {rc}")
                # the next position from the chunk's own count: the helper's new_n_past after a text chunk that
                # follows an image is not n_past + its tokens in this version (mtmd_helper_eval_chunks is right)
                n_past = llama_cpp.llama_pos(n_past.value + mt.mtmd_input_chunk_get_n_pos(chunk))
        finally:
            free(chunks, bitmaps)
        t0 = time.perf_counter()
        tokens, _ = decode_greedy(req["n"] + 1, n_past.value)  # n decode steps after the prompt's token
        decode_s = time.perf_counter() - t0
        return {"prompt_tokens": len(prompt), "encode_s": encode_s, "prefill_s": prefill_s, "decode_s": decode_s,
                "decoded": req["n"], "tokens": tokens, "rss_mb": _rss_mb()}

    ops = {"load": load, "greedy": greedy, "bench": bench}
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
