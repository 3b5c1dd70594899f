"""llama.cpp's own MTP drafts for a Qwen3.5 GGUF (run with the peer's Python: `peer_mtp.py FILE IDS K`, prints a
JSON list): the file loaded with load_mtp, a target context that keeps every position's h_nextn (the hidden
state after the output norm) and an MTP context (LLAMA_CONTEXT_TYPE_MTP) driven as common/speculative.cpp's
draft-mtp drives it: the prompt's tokens paired with the hidden state before each (zeros at position 0) at their
own positions, then the target's argmax after the prompt paired with the last hidden state, and each further
step the drafted token with the head's own h_nextn, greedy. The staging API functions (llama-ext.h) are called
by their C++ names.

    llama_drafts(gguf_path, ids, k) -> [the target's argmax after ids, then k drafts]   (from our Python)
"""
from __future__ import annotations

import ctypes
import json
import sys


def main(path: str, ids: list[int], k: int) -> list[int]:
    import llama_cpp as l
    import numpy as np

    lib = l.llama_cpp._lib
    set_nextn = lib["_Z26llama_set_embeddings_nextnP13llama_contextbb"]
    set_nextn.argtypes, set_nextn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
    nextn_ith = lib["_Z30llama_get_embeddings_nextn_ithP13llama_contexti"]
    nextn_ith.argtypes, nextn_ith.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)

    l.llama_backend_init()
    mp = l.llama_model_default_params()
    mp.load_mtp = True
    model = l.llama_model_load_from_file(path.encode(), mp)
    n_embd = l.llama_model_n_embd(model)

    def context(mtp: bool):
        cp = l.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 256, 256, 1, 1
        if mtp:
            cp.ctx_type = 1  # LLAMA_CONTEXT_TYPE_MTP
        return l.llama_init_from_model(model, cp)

    tgt, dft = context(False), context(True)
    set_nextn(tgt, True, False)
    set_nextn(dft, True, True)
    n = len(ids)
    batch = l.llama_batch_init(n, 0, 1)
    batch.n_tokens = n
    for i, t in enumerate(ids):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
        batch.seq_id[i][0] = 0
    assert l.llama_decode(tgt, batch) == 0
    h = np.stack([np.ctypeslib.as_array(nextn_ith(tgt, i), (n_embd,)).copy() for i in range(n)])  # (n, n_embd)
    vocab = l.llama_vocab_n_tokens(l.llama_model_get_vocab(model))
    nxt = int(np.argmax(np.ctypeslib.as_array(l.llama_get_logits_ith(tgt, n - 1), (vocab,))))

    keep = []

    def add(b, token: int, pos: int, row: np.ndarray, out: bool) -> int:
        row = np.ascontiguousarray(row, dtype=np.float32)
        keep.append(row)
        idx = l.llama_batch_ext_add_token(b, 0, token)
        p = (ctypes.c_int32 * 1)(pos)
        keep.append(p)
        l.llama_batch_ext_set_pos(b, idx, p)
        # the MTP graph reads h from the entry's embedding beside its token id (set_embd_token); set_embd_state
        # did not reach it in 0.3.36 (its drafts were the same with every row zero)
        l.llama_batch_ext_set_embd_token(b, idx, l.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd))
        l.llama_batch_ext_set_output_logits(b, idx, out)
        return idx

    b = l.llama_batch_ext_init(dft)
    prev = np.vstack([np.zeros((1, n_embd), np.float32), h[:-1]])  # (n, n_embd)
    for i, t in enumerate(ids):
        add(b, t, i, prev[i], False)
    assert l.llama_process(dft, 1, b) == 0  # LLAMA_PROCESS_TYPE_DECODE
    out, tok, row = [], nxt, h[-1]
    for i in range(k):
        l.llama_batch_ext_clear(b)
        idx = add(b, tok, n + i, row, True)
        assert l.llama_process(dft, 1, b) == 0
        tok = int(np.argmax(np.ctypeslib.as_array(l.llama_get_logits_ith(dft, idx), (vocab,))))
        row = np.ctypeslib.as_array(nextn_ith(dft, idx), (n_embd,)).copy()
        out.append(tok)
    return [nxt, *out]


def llama_drafts(path: str, ids: list[int], k: int) -> list[int]:
    """main() in the peer's venv (bench/peer.py builds it), from our interpreter."""
    import os
    import subprocess

    from tests.support.gguf_files import peer_module
    py = peer_module().ensure_peer()
    r = subprocess.run([py, os.path.abspath(__file__), path, json.dumps(list(ids)), str(k)], capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"peer_mtp.py failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))))
