"""bench/peer_isa.py: the instruction-set probes that decide how the llama.cpp peer is built. Each probe
program really runs here exactly when the CPU and the OS support its instruction set (compared with the
kernel's own flags), and a host listing AMX gets a build with AMX off, whether AMX runs there or not
(llama.cpp's AMX kernels crash on K-quant files: never the reference)."""
import os
import platform
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import peer_isa

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set probes")


@pytest.mark.parametrize("name,flag", [("avx2", "avx2"), ("avx512", "avx512bw"), ("avx512_bf16", "avx512_bf16")])
def test_probe_runs_what_the_cpu_lists(name, flag):
    # a listed set runs; the converse does not hold on every VM: the AMD EPYC of 2026-12-04 hid AVX-512 from
    # /proc/cpuinfo while executing it (the probe ran it), which is why the build trusts the probe, not the listing
    assert peer_isa.runs(name) or flag not in peer_isa.cpuinfo_flags()


def test_broken_probe_is_not_usable(monkeypatch):
    monkeypatch.setitem(peer_isa._PROBES, "avx2", ("-mavx2", "return 1;", ["GGML_AVX2"]))
    assert not peer_isa.runs("avx2")


def test_explicit_flags_turn_off_what_does_not_run(monkeypatch):
    monkeypatch.setenv("KESTREL_PEER_ISA", "probe")
    args = peer_isa.cmake_args("-DLLAMA_BUILD_TESTS=OFF").split()
    assert args[0] == "-DGGML_NATIVE=OFF" and args[-1] == "-DLLAMA_BUILD_TESTS=OFF"
    for o in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"):
        assert f"-D{o}=OFF" in args
    assert f"-DGGML_AVX2={'ON' if 'avx2' in peer_isa.cpuinfo_flags() else 'OFF'}" in args


def test_native_build_kept_only_where_amx_is_not_listed(monkeypatch):
    monkeypatch.delenv("KESTREL_PEER_ISA", raising=False)
    monkeypatch.setattr(peer_isa, "cpuinfo_flags", lambda: {"avx2", "amx_tile"})
    for amx_runs in (False, True):
        monkeypatch.setattr(peer_isa, "runs", lambda name, cc=None, amx_runs=amx_runs: name != "amx" or amx_runs)
        args = peer_isa.cmake_args().split()
        assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AMX_INT8=OFF" in args and "-DGGML_AVX2=ON" in args
    monkeypatch.setattr(peer_isa, "cpuinfo_flags", lambda: {"avx2"})
    assert peer_isa.cmake_args() == peer_isa.NATIVE_ARGS
