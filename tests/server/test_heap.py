"""server/heap.py: after many freed allocations below glibc's mmap threshold (held resident because one block
above them is still in use), release_free_heap gives their pages back to the kernel."""
import ctypes
import ctypes.util
import platform

import pytest

from appliance.server.heap import release_free_heap

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="malloc_trim is glibc's")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_freed_heap_goes_back_to_the_kernel():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(3200)]  # ~200 MB, each below the mmap threshold
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    keep = libc.malloc(64 * 1024)  # above them: the heap's top cannot shrink on free alone
    for b in blocks:
        libc.free(b)
    before = rss_mb()
    assert release_free_heap()
    after = rss_mb()
    libc.free(keep)
    assert before - after > 100, (before, after)
