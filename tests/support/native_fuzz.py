"""Shared pieces of the native fuzz tests (tests/native/test_native_fuzz*.py): hypothesis settings, the layouts an
input array may arrive in, and the pool/SIMD configuration an example runs under.

Policy: examples are derandomized (the same examples every run, so CI is reproducible) and modest in number;
KESTREL_FUZZ_SCALE=20 multiplies every test's example count for a long run (the counts are printed with
`pytest -s`, hypothesis' statistics with `--hypothesis-show-statistics`). With KESTREL_KERNEL_DRIVER set the
wrappers call the library through the test driver (tests/support/kernel_driver.py: the aarch64 NEON build under
qemu-aarch64, scripts/qemu_aarch64_kernels.sh), and every example checks that they still do.
"""
from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st

from tests.support import kernel_driver

kernels = kernel_driver.kernels_under_test()
SCALE = max(1, int(os.environ.get("KESTREL_FUZZ_SCALE", "1")))
LEVELS = list(range(kernels.simd_max() + 1)) if kernels.available() else [0]


def fuzz(examples: int):
    """hypothesis settings for `examples` examples (times KESTREL_FUZZ_SCALE), reproducible, no deadline (the
    machine is shared; a slow example is not a failure)."""
    return settings(max_examples=examples * SCALE, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# the layouts an input may come in: the wrappers convert all of them; the values are the same float32s
LAYOUTS = ["c", "fortran", "strided", "reversed", "float64"]


def layout(a: np.ndarray, kind: str) -> np.ndarray:
    """The same values as a (float32 or uint8) in another memory layout or an exactly wider dtype."""
    if kind == "fortran":
        return np.asfortranarray(a)
    if kind == "strided":  # every other element of a wider array along the last axis
        b = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        b[..., ::2] = a
        return b[..., ::2]
    if kind == "reversed":  # a negative-stride view
        return np.flip(np.ascontiguousarray(np.flip(a, 0)), 0) if a.ndim else a
    if kind == "float64" and a.dtype == np.float32:
        return a.astype(np.float64)
    return a


MACHINES = st.tuples(st.sampled_from(LEVELS), st.integers(1, 3))  # (SIMD level, pool threads)


def use(machine: tuple[int, int]) -> None:
    """Run the example's kernels at this SIMD level with this many pool threads."""
    level, threads = machine
    if kernel_driver.active():  # a module's teardown may have reloaded the host's library: never test that instead
        assert isinstance(kernels._lib, kernel_driver.DriverLib), "the kernel driver is not the library under test"
    assert kernels.set_simd_level(level) == level
    assert kernels.set_threads(threads) == threads


def normal(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    """Random float32 values with some exact zeros (and, when there is room, a whole zero block of 32)."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if x.size:
        flat = x.reshape(-1)
        flat[rng.integers(0, flat.size, max(1, flat.size // 50))] = 0.0
        if x.ndim == 2 and x.shape[1] >= 64 and rng.random() < 0.5:
            x[-1, 32:64] = 0.0
    return x
