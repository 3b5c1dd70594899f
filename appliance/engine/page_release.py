"""Give memory-mapped weight pages back to the kernel after use (madvise MADV_DONTNEED).

Policy: only read-only file-backed mappings are released, so a released page is simply read again from the
file on its next use; only pages lying wholly inside the array are released, never a neighbour's. Used by the
mixture-of-experts block, where most experts sit unused between tokens.
"""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise


def is_file_mapped(a: np.ndarray | None) -> bool:
    base: object = a
    while base is not None:
        if isinstance(base, (np.memmap, mmap.mmap)):
            return True
        base = getattr(base, "base", None)
    return False


def release_pages(a: np.ndarray | None) -> int:
    """Release the whole pages under array a (a view into a file mapping); returns the bytes released."""
    if a is None or os.name != "posix" or not is_file_mapped(a) or not a.flags.c_contiguous:
        return 0
    start = a.__array_interface__["data"][0]
    lo = -(-start // _PAGE) * _PAGE
    hi = (start + a.nbytes) // _PAGE * _PAGE
    if hi <= lo:
        return 0
    if _madvise()(lo, hi - lo, _MADV_DONTNEED) != 0:
        return 0
    return hi - lo


def mapping_rss(*arrays: np.ndarray) -> int:
    """Resident bytes (this process's RSS) of the file mappings that hold the given arrays (each mapping
    counted once), from /proc/self/smaps; -1 where that is not available. For reports and tests."""
    addrs = [a.__array_interface__["data"][0] for a in arrays]
    total, found = 0, False
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = any(lo <= addr < hi for addr in addrs)
                elif inside and head == "Rss:":
                    total += int(line.split()[1]) * 1024
                    found = True
    except OSError:
        return -1
    return total if found else -1


def resident_bytes(a: np.ndarray) -> int:
    """Bytes of the pages under array a that are mapped into this process now (present in its page table,
    read from /proc/self/pagemap: the same pages smaps counts as Rss, cheap to read for one range); -1 where
    that is not available."""
    start = a.__array_interface__["data"][0]
    first, last = start // _PAGE, (start + max(a.nbytes, 1) - 1) // _PAGE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
    except OSError:
        return -1
    return int(np.count_nonzero(entries >> np.uint64(63))) * _PAGE
