"""Check a replacement for numpy's OpenBLAS (build/numpy_blas.sh) before it goes into the executable.

    python build/check_numpy_blas.py LIBRARY       (run by the Python whose numpy it replaces)

A copy of that numpy, with LIBRARY in place of its libscipy_openblas64_*.so, is imported in a child process
and every family of routines numpy calls is compared with the numpy that came with the wheel: float32/64 and
complex matmul, matrix-vector and dot products (cblas), and the numpy.linalg drivers (LAPACK). Exits non-zero
with the first mismatch.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import numpy

CHECK = r"""
import itertools
import numpy as np
assert np.__file__.startswith(%(copy)r), np.__file__
with open("/proc/self/maps") as f:   # the library under test is the one numpy runs on
    blas = {line.split()[-1] for line in f if "libscipy_openblas" in line}
assert blas and all(path.startswith(%(copy)r) for path in blas), blas
rng = np.random.default_rng(0)
for dt, tol in ((np.float32, 1e-4), (np.float64, 1e-10), (np.complex64, 1e-4), (np.complex128, 1e-10)):
    a = rng.standard_normal((67, 45)).astype(dt); b = rng.standard_normal((45, 33)).astype(dt)
    if np.iscomplexobj(a):
        a = a + 1j * rng.standard_normal(a.shape).astype(dt); b = b - 1j * rng.standard_normal(b.shape).astype(dt)
    ref = np.einsum("ik,kj->ij", a.astype(np.complex128), b.astype(np.complex128))   # no BLAS
    scale = np.abs(ref).max()
    assert np.abs(a @ b - ref).max() <= tol * scale * 45, ("gemm", dt)
    assert np.abs(a @ b[:, 0] - ref[:, 0]).max() <= tol * scale * 45, ("gemv", dt)
    assert abs(np.dot(a[0], b[:, 0]) - ref[0, 0]) <= tol * scale * 45, ("dot", dt)
    assert np.abs(a @ a.T - np.einsum("ik,jk->ij", a, a)).max() <= tol * scale * 45, ("syrk", dt)
    m = rng.standard_normal((40, 40)).astype(dt) + 40 * np.eye(40, dtype=dt)
    x = rng.standard_normal(40).astype(dt)
    assert np.abs(m @ np.linalg.solve(m, x) - x).max() <= tol * 100, ("gesv", dt)
    u, s, vh = np.linalg.svd(m)
    assert np.abs((u * s) @ vh - m).max() <= tol * 100 * np.abs(m).max(), ("gesdd", dt)
    h = m @ m.conj().T
    w, v = np.linalg.eigh(h)
    assert np.abs(h @ v - v * w).max() <= tol * 100 * np.abs(h).max(), ("syevd/heevd", dt)
    assert np.abs(np.linalg.cholesky(h) @ np.linalg.cholesky(h).conj().T - h).max() <= tol * 100 * np.abs(h).max()
    q, r = np.linalg.qr(m)
    assert np.abs(q @ r - m).max() <= tol * 100 * np.abs(m).max(), ("geqrf/orgqr", dt)
    sol = np.linalg.lstsq(m[:, :30], x, rcond=None)[0]
    assert np.abs(m[:, :30].conj().T @ (m[:, :30] @ sol - x)).max() <= tol * 1e3 * np.abs(m).max(), ("gelsd", dt)
    ev = np.linalg.eigvals(m)
    assert abs(np.sum(ev) - np.trace(m)) <= tol * 1e3 * abs(np.trace(m)), ("geev", dt)
    m4 = m[:4, :4].astype(np.complex128)   # getrf through det, against the Leibniz sum (no LAPACK)
    ref = sum(np.prod([m4[i, p[i]] for i in range(4)]) * (-1) ** sum(p[i] > p[j] for i in range(4) for j in range(i))
              for p in itertools.permutations(range(4)))
    assert abs(np.linalg.det(m[:4, :4]) - ref) <= tol * 100 * abs(ref), ("getrf", dt)
print("numpy BLAS/LAPACK replacement: all checks passed")
"""


def main() -> int:
    library = os.path.abspath(sys.argv[1])
    site = os.path.dirname(os.path.dirname(numpy.__file__))
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(os.path.join(site, "numpy"), os.path.join(tmp, "numpy"))
        libs = shutil.copytree(os.path.join(site, "numpy.libs"), os.path.join(tmp, "numpy.libs"))
        shutil.copyfile(library, os.path.join(libs, os.path.basename(library)))
        env = dict(os.environ, PYTHONPATH=tmp)
        copy = os.path.join(tmp, "numpy")
        return subprocess.run([sys.executable, "-c", CHECK % {"copy": copy}], env=env, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
