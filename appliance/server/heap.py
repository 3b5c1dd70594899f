"""Giving freed heap back to the system once the engine goes idle.

Policy: a board has 8-32 GB and no swap worth the name, and a burst of image requests (decoded by Pillow in
worker threads, each thread with its own glibc arena) leaves tens of MB freed but still resident. When the engine
thread finds no job waiting after one ends, it calls glibc's malloc_trim(0), which returns the free pages of every
arena to the kernel (a few ms, never on the event loop). Where there is no glibc (musl, macOS) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return free heap pages to the kernel; True if the C library could."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))
