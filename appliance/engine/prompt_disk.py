"""PromptDiskCache: the KV of a prefix that recent requests share (in practice the system prompt), kept on disk
so the first request after a restart is warm (--prompt-cache-dir).

Policies:
- What is written: after each request, the longest common prefix of its prompt and the previous request's,
  when it has at least `min_tokens` tokens, ends before any image, and is not on disk already. At most
  `max_files` files are kept (the oldest go first).
- Writing never holds the engine: a writer thread (at nice 19) digests, writes and fsyncs the prefix straight
  from the cache's arrays; the engine copies what is not written yet (the snapshot) only when a request would
  overwrite those positions before the writer is through (PrefixWrite), so the usual next request, one that
  extends the prefix, costs no copy. One write is in flight at a time (a prefix seen meanwhile is not saved)
  and at most `write_budget` bytes are written per rolling hour (flash wears, and any client can make
  prefixes to share): past it a prefix is not saved, with one warning until the budget frees up.
- A file is keyed by the model's identity (the model path's files: names, sizes, modification times; the KV
  shape and element type) and the token ids. It is written to a temporary name, fsynced, renamed, and the
  directory fsynced: a crash leaves the old file or the new one, never half of one.
- Layout: MAGIC, a little-endian u32 header length, a JSON header (identity, tokens, shape, dtype, the payload's
  BLAKE2b digest), then the keys of every layer and the values of every layer, each (n_kv, n_tokens, hd).
  A hybrid model's file (Qwen3.5, recurrent_cache.HybridCache) is format 2 (MAGIC_STATES): the KV is its
  full-attention layers' and the header also lists `states`, the shapes of the float32 arrays that follow the
  KV (each linear layer's conv state then its delta state, in layer order: the recurrent states at the prefix's
  end). Such a prefix is saved only where the cache holds a state (cache.reusable), and a file serves exactly
  its own length (a state cannot be cut), so a longer prefix on disk does not stand for a shorter one.
- At load only regular files named *.kvc are opened (a FIFO, device, directory or dangling link is skipped
  unread), and never blocking. The header is checked from the file's first bytes (magic, header, identity,
  shape, the file's length) before the payload is read, once, into the arrays kept, then its digest. A file
  that fails is ignored with a warning naming it and the reason, never trusted and never deleted (it may be
  another model's). A temporary file of this model whose writing process is gone is deleted.
"""
from __future__ import annotations

import collections
import errno
import hashlib
import json
import logging
import os
import stat
import struct
import threading
import time

import numpy as np

from .prefix_cache import CachedSequence, ImageKey, common_prefix
from .prefix_write import PrefixWrite
from .recurrent_cache import RecurrentState

log = logging.getLogger("appliance.prompt_cache")
MAGIC = b"KESTREL-KV\x00\x01"          # format 1: keys and values
MAGIC_STATES = b"KESTREL-KV\x00\x02"   # format 2: keys and values, then recurrent states (hybrid models)
SUFFIX = ".kvc"
MAX_HEADER = 16 << 20       # bytes of JSON header a file may claim (a 256k-token prefix needs ~2 MB)
WRITE_BUDGET = 2 << 30      # default bytes written per rolling hour
BUDGET_WINDOW_S = 3600.0
READ_BLOCK = 16 << 20
WRITER_NICE = 19            # the writer thread's CPU priority (the lowest)


def model_identity(path: str, shape: tuple[int, int, int], dtype, states: tuple[tuple[int, ...], ...] = ()) -> str:
    """A digest of what makes keys/values valid: the model's files (name, size, mtime) and the cache layout
    (with a hybrid model's recurrent state shapes)."""
    path = os.path.abspath(path)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, n) for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.basename(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(f"{shape}\0{np.dtype(dtype).str}".encode())
    if states:
        h.update(f"\0states {[list(s) for s in states]}".encode())
    return h.hexdigest()


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def open_directory(directory: str) -> None:
    """Create the cache directory if needed; NotADirectoryError when something else (a file, a dangling link)
    has its name (makedirs would say only "File exists")."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory")
    os.makedirs(directory, exist_ok=True)


class PromptDiskCache:
    def __init__(self, directory: str, identity: str, shape: tuple[int, int, int], dtype,
                 min_tokens: int = 32, max_files: int = 8, write_budget: int = WRITE_BUDGET,
                 clock=time.monotonic, states: tuple[tuple[int, ...], ...] = ()):
        self.dir = directory
        self.identity = identity
        self.shape = tuple(shape)  # (n_layers, n_kv, hd): the KV layers (a hybrid model's full-attention ones)
        self.dtype = np.dtype(dtype)
        self.states = tuple(tuple(int(d) for d in s) for s in states)  # float32 state arrays (conv, ssm per layer)
        self.state_nbytes = sum(4 * int(np.prod(s)) for s in self.states)
        self.min_tokens = min_tokens
        self.max_files = max_files
        self.write_budget = write_budget
        self._clock = clock
        self._last: list[int] | None = None
        self._last_images: tuple[ImageKey, ...] = ()
        self.saved: list[list[int]] = []  # token ids of the prefixes on disk (this model)
        self._lock = threading.Lock()     # saved, the write in flight, the budget (engine and writer threads)
        self._writer: threading.Thread | None = None
        self._job: PrefixWrite | None = None
        self._written: collections.deque[tuple[float, int]] = collections.deque()  # (time, bytes) of writes
        self._over_budget = False
        open_directory(directory)

    @property
    def bytes_per_token(self) -> int:
        L, n_kv, hd = self.shape
        return 2 * L * n_kv * hd * self.dtype.itemsize

    def _name(self, tokens: list[int]) -> str:
        digest = hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=12).hexdigest()
        return os.path.join(self.dir, f"{self.identity[:16]}-{digest}{SUFFIX}")

    # ---- reading ---------------------------------------------------------------------------------------
    def load_all(self) -> list[CachedSequence]:
        """Every valid file of this model in the directory, newest first; others ignored with a warning."""
        found = []
        with os.scandir(self.dir) as it:
            for e in it:
                if not e.name.endswith(SUFFIX):
                    self._remove_if_stale(e.name)
                    continue
                try:
                    st = os.stat(e.path)  # follows a link: a link to a regular file is fine
                except OSError as err:
                    why = "a dangling symbolic link" if e.is_symlink() else (err.strerror or str(err))
                    log.warning("prompt cache: ignoring %s: %s", e.path, why)
                    continue
                if not stat.S_ISREG(st.st_mode):
                    log.warning("prompt cache: ignoring %s: %s", e.path, _kind(st.st_mode))
                    continue
                found.append((st.st_mtime_ns, e.path))
        out = []
        for _, path in sorted(found, reverse=True):
            try:
                entry = self._read(path)
            except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
                log.warning("prompt cache: ignoring %s: %s", path, getattr(err, "strerror", None) or err)
                continue
            out.append(entry)
            self.saved.append(entry.tokens)
        if out:
            log.info("prompt cache: loaded %d prefix(es) from %s (%s tokens)", len(out), self.dir,
                     ", ".join(str(len(e.tokens)) for e in out))
        return out

    def _remove_if_stale(self, name: str) -> None:
        """A temporary file of this model's whose writer process is gone (killed mid-write) is deleted."""
        stem, _, pid = name.rpartition(f"{SUFFIX}.tmp")
        if not stem.startswith(self.identity[:16]) or not pid.isdigit() or int(pid) == os.getpid():
            return
        try:
            os.kill(int(pid), 0)
            return  # its writer is alive (another server on this directory)
        except ProcessLookupError:
            pass
        except OSError:  # alive, another user's
            return
        try:
            os.unlink(os.path.join(self.dir, name))
            log.info("prompt cache: removed %s (a write that did not finish)", name)
        except OSError:
            pass

    def _read(self, path: str) -> CachedSequence:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # replaced since the directory was listed
                raise ValueError(_kind(st.st_mode))
            start = len(MAGIC) + 4
            first = _read_exactly(f, start)
            if len(first) < start or not first.startswith(MAGIC[:-1]):
                raise ValueError("not a prompt cache file")
            version, want = first[len(MAGIC) - 1], (MAGIC_STATES if self.states else MAGIC)[-1]
            if version not in (MAGIC[-1], MAGIC_STATES[-1]):
                raise ValueError(f"unknown format version {version}")
            if version != want:
                raise ValueError(f"format {version} ({'with' if version == MAGIC_STATES[-1] else 'without'} "
                                 f"recurrent states); this model's files are format {want}")
            (n_head,) = struct.unpack_from("<I", first, len(MAGIC))
            if n_head > MAX_HEADER:
                raise ValueError(f"header of {n_head} bytes claimed (at most {MAX_HEADER})")
            if start + n_head > st.st_size:
                raise ValueError("truncated header")
            head = json.loads(_read_exactly(f, n_head).decode("utf-8"))
            if head["identity"] != self.identity:
                raise ValueError("written for another model file or KV layout")
            tokens = [int(t) for t in head["tokens"]]
            L, n_kv, hd = self.shape
            if tuple(head["shape"]) != self.shape or np.dtype(head["dtype"]) != self.dtype or not tokens:
                raise ValueError("unexpected shape or element type")
            if self.states and [tuple(s) for s in head["states"]] != list(self.states):
                raise ValueError("unexpected recurrent state shapes")
            arrays = np.empty((2 * L, n_kv, len(tokens), hd), self.dtype)
            flat = np.empty(self.state_nbytes // 4, np.float32)  # every recurrent state array, in order
            size, have = arrays.nbytes + flat.nbytes, st.st_size - start - n_head
            if have != size:
                raise ValueError(f"truncated payload ({have} of {size} bytes)" if have < size
                                 else f"{have - size} bytes past the payload")
            digest = hashlib.blake2b(digest_size=16)
            got = 0
            for buf in (arrays.reshape(-1).view(np.uint8).data, flat.view(np.uint8).data):  # memoryviews
                _read_into(f, buf, got, size)
                digest.update(buf)
                got += len(buf)
        if digest.hexdigest() != head["digest"]:
            raise ValueError("payload digest mismatch (corrupted)")
        k, v = list(arrays[:L]), list(arrays[L:])  # views of one (2L, n_kv, n, hd)
        if not self.states:
            return CachedSequence(tokens, (), k, v)
        parts, at = [], 0
        for shape in self.states:
            parts.append(flat[at:at + int(np.prod(shape))].reshape(shape))
            at += parts[-1].size
        states = [RecurrentState(c, s) for c, s in zip(parts[0::2], parts[1::2])]
        return CachedSequence(tokens, (), k, v, {len(tokens): states})  # usable at its own length only

    # ---- writing ---------------------------------------------------------------------------------------
    def observe(self, prompt: list[int], images: tuple[ImageKey, ...], cache, cache_tokens: list[int]) -> None:
        """After a request (engine thread): start saving the prefix its prompt shares with the previous
        request's, if worth it and allowed; the writer thread reads it from the cache (see PrefixWrite)."""
        last, last_images = self._last, self._last_images
        self._last, self._last_images = list(prompt), images
        if last is None:
            return
        n = common_prefix(last, last_images, prompt, images)
        n = min([n] + [k[0] for k in images])  # text only: image pixels are not in the key
        n = min(n, common_prefix(cache_tokens, (), prompt, ()))  # what the cache really holds
        if self.states:
            n = cache.reusable(n)  # a hybrid cache: where it holds the recurrent states
        if n < self.min_tokens:
            return
        tokens = list(prompt[:n])
        with self._lock:
            if any(s == tokens if self.states else len(s) >= n and s[:n] == tokens for s in self.saved):
                return
            if self._job is not None and self._writer is not None and self._writer.is_alive():
                log.debug("prompt cache: a write is in flight; not saving %d tokens", n)
                return
            if not self._spend(n * self.bytes_per_token + self.state_nbytes):
                return
            if self.states:  # the states are never written in place (HybridCache.states_at): no copy to detach
                tail = [a for st in cache.states_at(n) for a in (st.conv, st.ssm)]
                self._job = PrefixWrite([*cache.kv.k, *cache.kv.v], n, tail)
            else:
                self._job = PrefixWrite([*cache.k, *cache.v], n)
            self._writer = threading.Thread(target=self._write_logged, args=(tokens, self._job),
                                            name="prompt-cache-writer", daemon=True)
            self._writer.start()

    def before_overwrite(self, position: int, copy: CachedSequence | None = None) -> None:
        """Engine thread, before the cache's keys/values from `position` on change: a write still reading
        positions past it goes on from `copy` (the engine's copy of the cache's sequence, made anyway for its
        prefix store) or else from its own copy of what it has not written yet."""
        job = self._job
        if job is not None and position < job.n:
            job.detach([*copy.k, *copy.v] if copy is not None and len(copy.tokens) >= job.n else None)

    def _spend(self, size: int) -> bool:
        """Whether `size` more bytes fit this hour's write budget (then counted); caller holds the lock."""
        now = self._clock()
        while self._written and self._written[0][0] <= now - BUDGET_WINDOW_S:
            self._written.popleft()
        if sum(b for _, b in self._written) + size > self.write_budget:
            if not self._over_budget:
                log.warning("prompt cache: not saving a %.1f MB prefix: the write budget (%.0f MB per hour) is "
                            "spent", size / 2**20, self.write_budget / 2**20)
            self._over_budget = True
            return False
        self._over_budget = False
        self._written.append((now, size))
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait for the write in flight (tests); True when none is left."""
        w = self._writer
        if w is not None:
            w.join(timeout)
        return w is None or not w.is_alive()

    def _write_logged(self, tokens: list[int], job: PrefixWrite) -> None:
        """The writer thread's body: one file, then the bookkeeping of what is on disk."""
        try:  # Linux: the nice value is per thread; the engine's CPU comes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):
            pass
        try:
            path = self._write(tokens, job)
        except OSError as e:
            log.warning("prompt cache: cannot write to %s: %s", self.dir, e)
            return
        finally:
            job.finish()
            with self._lock:
                if self._job is job:
                    self._job = None
        with self._lock:
            superseded = [] if self.states else [s for s in self.saved if len(s) <= len(tokens) and tokens[:len(s)] == s]
            self.saved = [s for s in self.saved if s not in superseded] + [tokens]
            while len(self.saved) > self.max_files:  # oldest first
                superseded.append(self.saved.pop(0))
        for s in superseded:
            old = self._name(s)
            if old != path:
                try:
                    os.unlink(old)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("prompt cache: cannot remove %s: %s", old, e)

    def _write(self, tokens: list[int], job: PrefixWrite) -> str:
        """Write one file atomically (temporary name, fsync, rename, directory fsync); return its path. The
        header goes first with a placeholder digest and is rewritten in place once the payload is through."""
        def header(digest: str) -> bytes:
            fields = {"identity": self.identity, "tokens": tokens, "shape": list(self.shape),
                      "dtype": self.dtype.str, "digest": digest}
            if self.states:
                fields["states"] = [list(s) for s in self.states]
            head = json.dumps(fields, separators=(",", ":")).encode()
            return (MAGIC_STATES if self.states else MAGIC) + struct.pack("<I", len(head)) + head

        path = self._name(tokens)
        tmp = f"{path}.tmp{os.getpid()}"
        digest = hashlib.blake2b(digest_size=16)
        try:
            with open(tmp, "wb") as f:
                f.write(header("0" * 32))
                job.write_to(f, digest)
                f.seek(0)
                f.write(header(digest.hexdigest()))
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
        log.info("prompt cache: wrote %d tokens (%.1f MB) to %s", len(tokens), job.nbytes / 2**20, path)
        return path


def _read_into(f, buf: memoryview, got: int, size: int) -> None:
    """Fill buf from f (got: payload bytes read before it, size: the whole payload's, for the message)."""
    at = 0
    while at < len(buf):
        n = f.readinto(buf[at:at + READ_BLOCK])
        if not n:
            raise ValueError(f"truncated payload ({got + at} of {size} bytes)")
        at += n


def _read_exactly(f, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = f.read(n - len(out))
        if not chunk:
            break
        out += chunk
    return out
