"""Small valid model files for the loader's fuzz tier (tests/support/file_fuzz.py): a few tens of KB each, so
thousands of mutated copies can be written and loaded in minutes.

- `write_gguf(path, arch)`: a tiny qwen3 / qwen3moe / llama GGUF written with the `gguf` package's writer (the
  reference writer, not ours): a 300-token byte-level BPE vocabulary (the 256 byte pieces, a few merges, the
  ChatML specials), a short ChatML template, random weights in F32, F16, Q8_0 and Q4_0.
- `write_mmproj(path)`: a CLIP-like mmproj GGUF header (general.architecture = clip, vision keys, v.* tensors),
  read through the shared container reader (gguf_file.GGUFFile) only.
- `write_hf_dir(out)`: a tiny Hugging Face Qwen3 directory (config.json, model.safetensors written by the
  `safetensors` package, a tokenizer.json of the same small vocabulary, a chat template).
"""
from __future__ import annotations

import json
import os

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
DIMS = dict(hidden=32, heads=2, kv_heads=1, head_dim=16, inter=64, layers=2, experts=4, top_k=2, moe_inter=32)


def byte_pieces() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel
    return sorted(ByteLevel.alphabet())


def vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 256 byte pieces, merges of common pairs, the specials (CONTROL, type 3)."""
    pieces = byte_pieces()
    merges, tokens = [], list(pieces)
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("r", "e")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    while len(tokens) < 300 - len(SPECIALS):
        tokens.append(f"<pad{len(tokens)}>")
    types = [1] * len(tokens) + [3] * len(SPECIALS)
    return tokens + SPECIALS, types, merges


def large_vocab(n: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of about `n` tokens: the 256 byte pieces, then one merge per further token,
    each a piece before it plus one byte piece (all two-piece tokens first, then three), the specials."""
    pieces = byte_pieces()
    tokens, merges = list(pieces), []
    for left in pieces + [a + b for a in pieces for b in pieces]:
        for b in pieces:
            if len(tokens) >= n - len(SPECIALS):
                return tokens + SPECIALS, [1] * len(tokens) + [3] * len(SPECIALS), merges
            tokens.append(left + b)
            merges.append(f"{left} {b}")
    raise ValueError(f"large_vocab builds up to {256 + 256 ** 2 + 256 ** 3} tokens")


def write_gguf(path: str, arch: str = "qwen3", seed: int = 0, n_vocab: int | None = None) -> str:
    """n_vocab: a large_vocab of that size instead of the 300-token one (a tokenizer and a grammar table that
    take a moment to build: tests/system/test_load_answers.py)."""
    import gguf

    d, rng = DIMS, np.random.default_rng(seed)
    H, hd, nh, kv, inter = d["hidden"], d["head_dim"], d["heads"], d["kv_heads"], d["inter"]
    tokens, types, merges = vocab() if n_vocab is None else large_vocab(n_vocab)
    if arch == "qwen3vl":  # the text side of a Qwen3-VL pair (write_vl_mmproj): M-RoPE sections, DeepStack, image pad
        tokens, types = tokens + VL_SPECIALS, types + [3] * len(VL_SPECIALS)
    w = gguf.GGUFWriter(path, arch)
    if arch == "qwen3vl":
        w.add_array("qwen3vl.rope.dimension_sections", [2, 3, 3, 0])
        w.add_uint32("qwen3vl.n_deepstack_layers", 1)
    w.add_block_count(d["layers"])
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(inter)
    w.add_head_count(nh)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "qwen3moe":
        w.add_expert_count(d["experts"])
        w.add_expert_used_count(d["top_k"])
        w.add_expert_feed_forward_length(d["moe_inter"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_chat_template(TEMPLATE)
    w.add_float32("general.sampling.temp", 0.7)

    def matrix(name, rows, cols, qtype):  # numpy (rows, cols) -> GGUF ne [cols, rows]
        x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.2
        if qtype == "F32":
            w.add_tensor(name, x)
        elif qtype == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(x, t), raw_dtype=t)

    def vector(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), H, "Q8_0")
    for i in range(d["layers"]):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", H)
        matrix(b + "attn_q.weight", nh * hd, H, "Q8_0")
        matrix(b + "attn_k.weight", kv * hd, H, "F16")
        matrix(b + "attn_v.weight", kv * hd, H, "Q4_0")
        matrix(b + "attn_output.weight", H, nh * hd, "F32")
        if arch != "llama":
            vector(b + "attn_q_norm.weight", hd)
            vector(b + "attn_k_norm.weight", hd)
        vector(b + "ffn_norm.weight", H)
        if arch == "qwen3moe":
            E, mi = d["experts"], d["moe_inter"]
            matrix(b + "ffn_gate_inp.weight", E, H, "F32")
            for proj, shape in (("gate", (E, mi, H)), ("up", (E, mi, H)), ("down", (E, H, mi))):
                x = rng.standard_normal(shape).astype(np.float32) * 0.2
                t = gguf.GGMLQuantizationType.Q8_0
                w.add_tensor(b + f"ffn_{proj}_exps.weight", gguf.quants.quantize(x, t), raw_dtype=t)
        else:
            matrix(b + "ffn_gate.weight", inter, H, "Q8_0")
            matrix(b + "ffn_up.weight", inter, H, "Q4_0")
            matrix(b + "ffn_down.weight", H, inter, "Q8_0")
    vector("output_norm.weight", H)
    if arch == "llama":
        matrix("output.weight", len(tokens), H, "F16")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_mmproj(path: str, seed: int = 0) -> str:
    """A CLIP-like projector file's layout (llama.cpp's mmproj naming): vision hyper-parameters and v.* tensors."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "qwen3vl_merger")
    w.add_uint32("clip.vision.embedding_length", 32)
    w.add_uint32("clip.vision.block_count", 1)
    w.add_uint32("clip.vision.attention.head_count", 2)
    w.add_uint32("clip.vision.patch_size", 16)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_tensor("v.patch_embd.weight", rng.standard_normal((32, 3, 16, 16)).astype(np.float16))
    w.add_tensor("v.position_embd.weight", rng.standard_normal((16, 32)).astype(np.float32))
    for name, shape in (("v.blk.0.attn_qkv.weight", (96, 32)), ("v.blk.0.attn_out.weight", (32, 32)),
                        ("v.blk.0.ffn_up.weight", (64, 32)), ("v.blk.0.ffn_down.weight", (32, 64)),
                        ("mm.0.weight", (64, 128)), ("mm.2.weight", (32, 64))):
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float16))
    for name in ("v.blk.0.ln1.weight", "v.blk.0.ln1.bias", "v.post_ln.weight"):
        w.add_tensor(name, rng.standard_normal(32).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


VL_DIMS = dict(hidden=32, heads=2, inter=64, patch=4, merge=2, depth=2, positions=16, channels=3)


def write_vl_mmproj(path: str, seed: int = 0, shapes: dict | None = None, keys: dict | None = None) -> str:
    """A whole Qwen3-VL vision tower (llama.cpp's mmproj layout, clip / qwen3vl_merger) for write_gguf's qwen3vl
    text file: VL_DIMS, DeepStack after vision layer 0, weights F16 (matrices) and F32 (vectors, the position
    table). `shapes` {tensor: numpy shape, or None to leave it out} and `keys` {clip.vision key: value} replace
    what it writes (crafted mismatches)."""
    import gguf

    d, rng = VL_DIMS, np.random.default_rng(seed)
    h, inner, p, merged = d["hidden"], d["inter"], d["patch"], d["hidden"] * d["merge"] ** 2
    out = DIMS["hidden"]
    want: dict[str, tuple] = {"v.patch_embd.weight": (h, d["channels"], p, p),
                              "v.patch_embd.weight.1": (h, d["channels"], p, p), "v.patch_embd.bias": (h,),
                              "v.position_embd.weight": (d["positions"], h)}
    for i in range(d["depth"]):
        for name, shape in (("ln1", (h,)), ("attn_qkv", (3 * h, h)), ("attn_out", (h, h)), ("ln2", (h,)),
                            ("ffn_up", (inner, h)), ("ffn_down", (h, inner))):
            want[f"v.blk.{i}.{name}.weight"], want[f"v.blk.{i}.{name}.bias"] = shape, shape[:1]
    for prefix, norm in (("", h), ("v.deepstack.0.", merged)):
        names = ("v.post_ln", "mm.0", "mm.2") if not prefix else (prefix + "norm", prefix + "fc1", prefix + "fc2")
        for name, shape in zip(names, ((norm,), (merged, merged), (out, merged))):
            want[name + ".weight"], want[name + ".bias"] = shape, shape[:1]
    want.update(shapes or {})
    w = gguf.GGUFWriter(path, "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "qwen3vl_merger")
    w.add_bool("clip.use_gelu", True)
    meta = {"embedding_length": h, "feed_forward_length": inner, "block_count": d["depth"],
            "attention.head_count": d["heads"], "patch_size": p, "spatial_merge_size": d["merge"],
            "projection_dim": out, **(keys or {})}
    for key, value in meta.items():
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.is_deepstack_layers", [True] + [False] * (d["depth"] - 1))
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    for name, shape in want.items():
        if shape is None:
            continue
        x = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        w.add_tensor(name, x if len(shape) == 1 or name == "v.position_embd.weight" else x.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_hf_dir(out: str, seed: int = 0) -> str:
    """A tiny Qwen3ForCausalLM directory (tied embeddings), model.safetensors in BF16 (and F32 norms)."""
    import tokenizers
    import torch
    from safetensors.torch import save_file
    from tokenizers import decoders, models, pre_tokenizers

    d, rng = DIMS, np.random.default_rng(seed)
    H, hd, nh, kv, inter = d["hidden"], d["head_dim"], d["heads"], d["kv_heads"], d["inter"]
    tokens, types, merges = vocab()
    os.makedirs(out, exist_ok=True)
    cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": len(tokens), "hidden_size": H,
           "intermediate_size": inter, "num_hidden_layers": d["layers"], "num_attention_heads": nh,
           "num_key_value_heads": kv, "head_dim": hd, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 256, "tie_word_embeddings": True, "eos_token_id": len(tokens) - 1}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)

    def bf16(shape):  # float32 -> bfloat16 bits (truncated), as uint16 (numpy has no bfloat16)
        return (rng.standard_normal(shape).astype(np.float32) * 0.2).view(np.uint32) >> 16

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": bf16((len(tokens), H)).astype(np.uint16),
                                "model.norm.weight": np.ones(H, np.float32)}
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (nh * hd, H)), ("self_attn.k_proj", (kv * hd, H)),
                            ("self_attn.v_proj", (kv * hd, H)), ("self_attn.o_proj", (H, nh * hd)),
                            ("mlp.gate_proj", (inter, H)), ("mlp.up_proj", (inter, H)), ("mlp.down_proj", (H, inter))):
            t[p + name + ".weight"] = bf16(shape).astype(np.uint16)
        for name, n in (("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.q_norm", hd),
                        ("self_attn.k_norm", hd)):
            t[p + name + ".weight"] = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    path = os.path.join(out, "model.safetensors")
    save_file({k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if v.dtype == np.uint16
               else torch.from_numpy(v) for k, v in t.items()}, path)
    vocab_map = {tok: i for i, tok in enumerate(tokens)}
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab_map, merges=[tuple(m.split(" ")) for m in merges]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    tk.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template": TEMPLATE}, f)
    return out
