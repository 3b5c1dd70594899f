"""Which x86 instruction sets this host can actually execute, for building the llama.cpp peer (bench/peer.py).

Policy: a CPU flag in /proc/cpuinfo is not proof. Virtual machines list AMX (and, rarely, others) while the
hypervisor or the kernel does not enable its register state, and llama.cpp built with GGML_NATIVE then dies
with SIGILL on its first AMX tile instruction. So each instruction set is probed by compiling a tiny program
that uses it (AMX: after the same arch_prctl permission request ggml makes) and running it in a child
process; only what ran enables the matching GGML_* option.

And where AMX does run, the peer is still built without it: llama.cpp's AMX buffer type (used for batched
matmuls of Q4_0/Q4_1/Q8_0/K-quant/IQ4_XS weights) segfaults in ggml_backend_amx_mul_mat on K-quant files
(llama.cpp issue 20824, open; seen here on prompt processing of Q4_K_M/Q5_K_M/IQ4_XS files at 0.3.36) and
gave wrong Q4_0/Q4_1 results (PR 16315). A reference must be right before it is fast, and no board we ship
to has AMX, so on any CPU listing amx_tile the build is the explicit form with AMX off.

    cmake_args()   # '-DGGML_NATIVE=ON ...' when a native build is safe here, else explicit GGML_* flags
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import tempfile

# name: (gcc flags, body of main() returning 0 on success, GGML cmake options it enables)
_PROBES = {
    "avx": ("-mavx", "__m256 a = _mm256_set1_ps(v); a = _mm256_add_ps(a, a); return _mm256_cvtss_f32(a) != 2 * v;",
            ["GGML_AVX"]),
    "avx2": ("-mavx2", "__m256i a = _mm256_set1_epi32((int)v); a = _mm256_add_epi32(a, a);"
             " return _mm256_extract_epi32(a, 3) != 2;", ["GGML_AVX2"]),
    "fma": ("-mfma", "__m256 a = _mm256_set1_ps(v); a = _mm256_fmadd_ps(a, a, a); return _mm256_cvtss_f32(a) != 2;",
            ["GGML_FMA"]),
    "f16c": ("-mf16c", "__m128 a = _mm_cvtph_ps(_mm_set1_epi16(0x3c00)); return _mm_cvtss_f32(a) != v;",
             ["GGML_F16C"]),
    "bmi2": ("-mbmi2", "return _pdep_u32(1u, 2u) != 2u * (unsigned)v;", ["GGML_BMI2"]),
    "avx_vnni": ("-mavxvnni", "__m256i a = _mm256_set1_epi8(1); a = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, a);"
                 " return _mm256_extract_epi32(a, 0) != 4 * (int)v;", ["GGML_AVX_VNNI"]),
    "avx512": ("-mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw",
               "__m512i a = _mm512_set1_epi8(1); a = _mm512_add_epi8(a, a); __m512d d = _mm512_set1_pd(v);"
               " d = _mm512_xor_pd(d, d); return _mm512_reduce_add_epi32(a) != 16 * 0x02020202 || _mm512_reduce_add_pd(d) != 0;",
               ["GGML_AVX512"]),
    "avx512_vbmi": ("-mavx512f -mavx512vbmi", "__m512i a = _mm512_set1_epi8(3);"
                    " a = _mm512_permutexvar_epi8(_mm512_setzero_si512(), a); return _mm512_reduce_add_epi32(a) != 16 * 0x03030303;",
                    ["GGML_AVX512_VBMI"]),
    "avx512_vnni": ("-mavx512f -mavx512vnni", "__m512i a = _mm512_set1_epi8(1);"
                    " a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, a); return _mm512_reduce_add_epi32(a) != 64 * (int)v;",
                    ["GGML_AVX512_VNNI"]),
    "avx512_bf16": ("-mavx512f -mavx512bf16", "__m512 a = _mm512_set1_ps(v); __m512bh b = _mm512_cvtne2ps_pbh(a, a);"
                    " a = _mm512_dpbf16_ps(_mm512_setzero_ps(), b, b); return _mm512_reduce_add_ps(a) != 32;",
                    ["GGML_AVX512_BF16"]),
    "amx": ("-mamx-tile -mamx-int8 -mamx-bf16", r"""
        struct { unsigned char palette, start; unsigned char pad[14]; unsigned short colsb[16]; unsigned char rows[16]; } cfg;
        static signed char a[16 * 64], b[16 * 64]; static int d[16 * 16];
        if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return 2;
        memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
        for (int i = 0; i < 3; i++) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
        memset(a, 1, sizeof a); memset(b, (int)v, sizeof b);
        _tile_loadconfig(&cfg); _tile_zero(0); _tile_loadd(1, a, 64); _tile_loadd(2, b, 64);
        _tile_dpbssd(0, 1, 2); _tile_stored(0, d, 64); _tile_release();
        return d[17] != 64;""", ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"]),
}
_HEADER = "#include <immintrin.h>\n#include <string.h>\n#include <unistd.h>\n#include <sys/syscall.h>\n" \
          "volatile float vv = 1.0f;\nint main(void) { float v = vv;\n"
NATIVE_ARGS = "-DGGML_NATIVE=ON"


def cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runs(name: str, cc: str | None = None) -> bool:
    """Compile the probe of one instruction set and run it: True only if it exited 0 (no SIGILL)."""
    flags, body, _ = _PROBES[name]
    with tempfile.TemporaryDirectory(prefix="isa-probe-") as d:
        src, exe = os.path.join(d, "p.c"), os.path.join(d, "p")
        with open(src, "w") as f:
            f.write(_HEADER + body + "\n}\n")
        cmd = [*shlex.split(cc or os.environ.get("CC") or "cc"), "-O1", *flags.split(), src, "-o", exe]
        try:
            if subprocess.run(cmd, capture_output=True, timeout=60).returncode != 0:
                return False
            return subprocess.run([exe], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


def usable() -> dict[str, bool]:
    return {name: runs(name) for name in _PROBES}


def cmake_args(base: str = "") -> str:
    """llama.cpp's CMAKE_ARGS for this host. GGML_NATIVE=ON (which the compiler resolves from CPUID) when the
    host has no AMX flag; otherwise GGML_NATIVE=OFF with every other GGML_* instruction-set option set to what
    its probe showed, and AMX always off (see the policy above). KESTREL_PEER_ISA=probe forces the explicit
    form anywhere."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"{NATIVE_ARGS} {base}".strip()
    forced = os.environ.get("KESTREL_PEER_ISA", "") == "probe"
    if not forced and "amx_tile" not in cpuinfo_flags():
        return f"{NATIVE_ARGS} {base}".strip()
    ok = usable()
    ok["amx"] = False  # llama.cpp's AMX kernels crash on K-quants: never the reference
    opts = ["-DGGML_NATIVE=OFF"]
    for name, (_, _, options) in _PROBES.items():
        opts += [f"-D{o}={'ON' if ok[name] else 'OFF'}" for o in options]
    return " ".join([*opts, base]).strip()


if __name__ == "__main__":
    for name, ok in usable().items():
        print(f"{name:12s} {'runs' if ok else 'no'}")
    print(cmake_args())
