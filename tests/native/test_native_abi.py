"""The structs shared with ctypes are checked at load: ABI version and every struct's size as compiled."""
import ctypes

import pytest

from appliance.native import abi, kernels


class FakeLib:
    def __init__(self, version=abi.ABI_VERSION, sizes=None):
        self.version, self.sizes = version, sizes or [ctypes.sizeof(s) for s in abi.STRUCTS]

    def kq_abi_version(self):
        return self.version

    def kq_struct_size(self, i):
        return self.sizes[i] if i < len(self.sizes) else -1


def test_the_built_library_matches_the_declared_structs():
    if not kernels.available():
        pytest.skip(f"native library not available: {kernels.load_error}")
    abi.check(kernels._lib)  # raises on a mismatch
    assert [kernels._lib.kq_struct_size(i) for i in range(len(abi.STRUCTS))] == \
        [ctypes.sizeof(s) for s in abi.STRUCTS]
    assert kernels._lib.kq_struct_size(len(abi.STRUCTS)) == -1


def test_a_mismatch_is_refused():
    abi.check(FakeLib())
    with pytest.raises(OSError, match="ABI version"):
        abi.check(FakeLib(version=abi.ABI_VERSION + 1))
    sizes = [ctypes.sizeof(s) for s in abi.STRUCTS]
    sizes[1] += 8  # e.g. a field added to kq_layer on one side only
    with pytest.raises(OSError, match="Layer"):
        abi.check(FakeLib(sizes=sizes))
