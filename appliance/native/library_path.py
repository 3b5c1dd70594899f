"""Where the kernel library's file is: $KESTREL_NATIVE_LIB, else the newest `_kestrel_native*.so` next to this
file. Imports nothing heavy (the server's socket layer reads it before numpy is imported)."""
from __future__ import annotations

import glob
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def library_candidates() -> list[str]:
    env = os.environ.get("KESTREL_NATIVE_LIB")
    if env:
        return [env]
    # `pip install -e .` (setup.py) and `python -m appliance.native.build` name the library differently: the one
    # built last wins, so a stale build of the other kind never shadows a fresh one
    return sorted(glob.glob(os.path.join(_HERE, "_kestrel_native*.so")), key=os.path.getmtime, reverse=True)
