"""PromptDiskCache: the KV of a prefix that recent requests share (in practice the system prompt), kept on disk
so the first request after a restart is warm (--prompt-cache-dir).

Policies:
- What is written: after each request, the longest common prefix of its prompt and the previous request's,
  when it has at least `min_tokens` tokens, ends before any image, and is not on disk already. At most
  `max_files` files are kept (the oldest go first).
- A file is keyed by the model's identity (the model path's files: names, sizes, modification times; the KV
  shape and element type) and the token ids. It is written to a temporary name, fsynced, renamed, and the
  directory fsynced: a crash leaves the old file or the new one, never half of one.
- Layout: MAGIC, a little-endian u32 header length, a JSON header (identity, tokens, shape, dtype, the payload's
  BLAKE2b digest), then the keys of every layer and the values of every layer, each (n_kv, n_tokens, hd).
- At load every file is checked (magic, header, identity, shape, length, digest); one that fails is ignored
  with a warning naming the reason, never trusted and never deleted (it may be another model's).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct

import numpy as np

from .prefix_cache import CachedSequence, ImageKey, common_prefix

log = logging.getLogger("appliance.prompt_cache")
MAGIC = b"KESTREL-KV\x00\x01"
SUFFIX = ".kvc"


def model_identity(path: str, shape: tuple[int, int, int], dtype) -> str:
    """A digest of what makes keys/values valid: the model's files (name, size, mtime) and the cache layout."""
    path = os.path.abspath(path)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, n) for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.basename(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(f"{shape}\0{np.dtype(dtype).str}".encode())
    return h.hexdigest()


class PromptDiskCache:
    def __init__(self, directory: str, identity: str, shape: tuple[int, int, int], dtype,
                 min_tokens: int = 32, max_files: int = 8):
        self.dir = directory
        self.identity = identity
        self.shape = tuple(shape)  # (n_layers, n_kv, hd)
        self.dtype = np.dtype(dtype)
        self.min_tokens = min_tokens
        self.max_files = max_files
        self._last: list[int] | None = None
        self._last_images: tuple[ImageKey, ...] = ()
        self.saved: list[list[int]] = []  # token ids of the prefixes on disk (this model)
        os.makedirs(directory, exist_ok=True)

    def _name(self, tokens: list[int]) -> str:
        digest = hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=12).hexdigest()
        return os.path.join(self.dir, f"{self.identity[:16]}-{digest}{SUFFIX}")

    # ---- reading ---------------------------------------------------------------------------------------
    def load_all(self) -> list[CachedSequence]:
        """Every valid file of this model in the directory, newest first; others ignored with a warning."""
        out = []
        names = sorted((n for n in os.listdir(self.dir) if n.endswith(SUFFIX)),
                       key=lambda n: -os.path.getmtime(os.path.join(self.dir, n)))
        for name in names:
            path = os.path.join(self.dir, name)
            try:
                entry = self._read(path)
            except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
                log.warning("prompt cache: ignoring %s: %s", path, e)
                continue
            out.append(entry)
            self.saved.append(entry.tokens)
        if out:
            log.info("prompt cache: loaded %d prefix(es) from %s (%s tokens)", len(out), self.dir,
                     ", ".join(str(len(e.tokens)) for e in out))
        return out

    def _read(self, path: str) -> CachedSequence:
        with open(path, "rb") as f:
            data = f.read()
        if not data.startswith(MAGIC):
            raise ValueError("not a prompt cache file")
        (n_head,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        if start + n_head > len(data):
            raise ValueError("truncated header")
        head = json.loads(data[start:start + n_head].decode("utf-8"))
        if head["identity"] != self.identity:
            raise ValueError("written for another model file or KV layout")
        tokens = [int(t) for t in head["tokens"]]
        L, n_kv, hd = self.shape
        if tuple(head["shape"]) != self.shape or np.dtype(head["dtype"]) != self.dtype or not tokens:
            raise ValueError("unexpected shape or element type")
        payload = memoryview(data)[start + n_head:]
        per = n_kv * len(tokens) * hd * self.dtype.itemsize
        if len(payload) != 2 * L * per:
            raise ValueError(f"truncated payload ({len(payload)} of {2 * L * per} bytes)")
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != head["digest"]:
            raise ValueError("payload digest mismatch (corrupted)")
        arrays = np.frombuffer(payload, dtype=self.dtype).reshape(2 * L, n_kv, len(tokens), hd)  # (2L, n_kv, n, hd)
        return CachedSequence(tokens, (), [a.copy() for a in arrays[:L]], [a.copy() for a in arrays[L:]])

    # ---- writing ---------------------------------------------------------------------------------------
    def observe(self, prompt: list[int], images: tuple[ImageKey, ...], cache, cache_tokens: list[int]) -> None:
        """After a request: save the prefix its prompt shares with the previous request's, if worth it."""
        last, last_images = self._last, self._last_images
        self._last, self._last_images = list(prompt), images
        if last is None:
            return
        n = common_prefix(last, last_images, prompt, images)
        n = min([n] + [k[0] for k in images])  # text only: image pixels are not in the key
        n = min(n, common_prefix(cache_tokens, (), prompt, ()))  # what the cache really holds
        if n < self.min_tokens or any(len(s) >= n and s[:n] == prompt[:n] for s in self.saved):
            return
        k, v = cache.copy_prefix(n)
        try:
            self._write(list(prompt[:n]), k, v)
        except OSError as e:
            log.warning("prompt cache: cannot write to %s: %s", self.dir, e)

    def _write(self, tokens: list[int], k: list[np.ndarray], v: list[np.ndarray]) -> None:
        payload = b"".join(np.ascontiguousarray(a, dtype=self.dtype).tobytes() for a in (*k, *v))
        head = json.dumps({"identity": self.identity, "tokens": tokens, "shape": list(self.shape),
                           "dtype": self.dtype.str, "digest": hashlib.blake2b(payload, digest_size=16).hexdigest()},
                          separators=(",", ":")).encode()
        path = self._name(tokens)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(head)) + head)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        log.info("prompt cache: wrote %d tokens (%.1f MB) to %s", len(tokens), len(payload) / 2**20, path)
        superseded = [s for s in self.saved if len(s) <= len(tokens) and tokens[:len(s)] == s]
        self.saved = [s for s in self.saved if s not in superseded] + [tokens]
        while len(self.saved) > self.max_files:  # oldest first
            superseded.append(self.saved.pop(0))
        for s in superseded:
            if self._name(s) != path and os.path.exists(self._name(s)):
                os.unlink(self._name(s))
