"""The C structs shared with ctypes (src/kq.h), in one place, and the check made at load: the library's ABI
version (kq_abi_version) and each struct's size as the C compiler laid it out (kq_struct_size) must equal
what this side declares; otherwise the library is not used (the numpy path serves)."""
from __future__ import annotations

import ctypes

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
ABI_VERSION = 8
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
VECTORS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "q_bias", "k_bias", "v_bias")


class Linear(ctypes.Structure):  # kq_linear
    _fields_ = [("qtype", _I32), ("pad", _I32), ("w", _P), ("rows", _I64), ("n", _I64), ("nbytes", _I64)]


class Layer(ctypes.Structure):  # kq_layer
    _fields_ = [(n, Linear) for n in LINEARS] + [(n, _P) for n in VECTORS] + [("moe", _P)]


class Model(ctypes.Structure):  # kq_model
    _fields_ = [("n_layers", _I64), ("hidden", _I64), ("n_heads", _I64), ("n_kv", _I64), ("head_dim", _I64),
                ("inter", _I64), ("eps", ctypes.c_float), ("pad", _I32), ("layers", _P)]


class MoE(ctypes.Structure):  # kq_moe
    _fields_ = [("n_experts", _I64), ("top_k", _I64), ("hidden", _I64), ("inter", _I64),
                ("norm_topk", _I32), ("gate_qtype", _I32), ("up_qtype", _I32),
                ("down_qtype", _I32), ("router", _P), ("gate", _P), ("up", _P), ("down", _P),
                ("counts", _P), ("gate_bytes", _P), ("up_bytes", _P), ("down_bytes", _P)]


STRUCTS = (Linear, Layer, Model, MoE)  # kq_struct_size(i) is the C size of STRUCTS[i]


def check(lib) -> None:
    """Raise OSError unless the library speaks this ABI (version and struct sizes)."""
    if lib.kq_abi_version() != ABI_VERSION:
        raise OSError(f"ABI version {lib.kq_abi_version()} != {ABI_VERSION}")
    for i, struct in enumerate(STRUCTS):
        size = lib.kq_struct_size(i)
        if size != ctypes.sizeof(struct):
            raise OSError(f"struct {struct.__name__}: {size} bytes in the library, {ctypes.sizeof(struct)} here")
