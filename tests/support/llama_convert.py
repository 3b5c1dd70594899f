"""llama.cpp's own converter (convert_hf_to_gguf.py with its conversion/ package and gguf-py), from the peer's
source distribution: files made the way the published GGUFs are made.

Decision: the sdist of the peer (bench/peer.py's PACKAGE, llama-cpp-python) carries vendor/llama.cpp; it is
fetched once with `pip download --no-binary :all: --no-deps` into ~/.cache/kestrel-bench/sdist (or
$KESTREL_LLAMA_SDIST_DIR) and only the converter's files are unpacked, under a file lock. The converter runs
with this project's interpreter (it needs torch, transformers, numpy and sentencepiece: the test extras); the
script puts its vendored gguf-py first on its path itself, so the gguf package is the one it was written for.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile

from tests.support.gguf_files import peer_module

MEMBERS = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/", "vendor/llama.cpp/gguf-py/",
           "llama_cpp/mtmd_cpp.py")


def cache_dir() -> str:
    d = os.path.expanduser(os.environ.get("KESTREL_LLAMA_SDIST_DIR", "~/.cache/kestrel-bench/sdist"))
    os.makedirs(d, exist_ok=True)
    return d


def llama_cpp_tree() -> str:
    """The vendored llama.cpp directory holding convert_hf_to_gguf.py (downloaded and unpacked once)."""
    package = peer_module().PACKAGE  # "llama-cpp-python==X"
    version = package.split("==")[1]
    base = cache_dir()
    root = os.path.join(base, f"llama_cpp_python-{version}")
    tree = os.path.join(root, "vendor", "llama.cpp")
    with open(os.path.join(base, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(tree, "convert_hf_to_gguf.py")):
            return tree
        sdist = os.path.join(base, f"llama_cpp_python-{version}.tar.gz")
        if not os.path.exists(sdist):
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", package,
                            "-d", base], check=True, capture_output=True, timeout=900)
        with tarfile.open(sdist) as tar:
            prefix = f"llama_cpp_python-{version}/"
            wanted = [m for m in tar.getmembers()
                      if any(m.name.startswith(prefix + p) for p in MEMBERS)]
            tar.extractall(base, members=wanted, filter="data")
    return tree


def llama_cpp_file(rel: str) -> str:
    """A file of the vendored llama.cpp tree (e.g. "models/ggml-vocab-qwen35.gguf", a vocabulary-only file with
    its tokenizer test's texts and ids beside it), unpacked from the source distribution on first use."""
    tree = llama_cpp_tree()
    path = os.path.join(tree, rel)
    with open(os.path.join(cache_dir(), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            version = peer_module().PACKAGE.split("==")[1]
            name = f"llama_cpp_python-{version}/vendor/llama.cpp/{rel}"
            with tarfile.open(os.path.join(cache_dir(), f"llama_cpp_python-{version}.tar.gz")) as tar:
                tar.extractall(cache_dir(), members=[tar.getmember(name)], filter="data")
    return path


def convert_hf(src: str, out: str, outtype: str, mmproj: bool = False, timeout: float = 600,
               extra: tuple[str, ...] = ()) -> str:
    """Run llama.cpp's converter on the Hugging Face directory src: the text model, or with mmproj=True the vision
    projector, as `outtype` (f32, f16, bf16, q8_0); `extra` are more converter flags (e.g. "--no-mtp": a Qwen3.5
    checkpoint without its multi-token-prediction head). Returns out."""
    tree = llama_cpp_tree()
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the script puts its gguf-py first
    cmd = [sys.executable, os.path.join(tree, "convert_hf_to_gguf.py"), "--outtype", outtype, "--outfile", out]
    p = subprocess.run(cmd + (["--mmproj"] if mmproj else []) + list(extra) + [src], env=env, capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({p.returncode}): {p.stderr[-2000:]}")
    return out
