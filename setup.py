"""Builds the optional native kernel library (appliance/native/src) as a plain shared object that
appliance/native/kernels.py loads with ctypes. Policy: the build is optional — if the compiler is missing
or fails, the install still succeeds and the engine runs on its numpy path."""
import importlib.util
import os

from setuptools import Extension, setup

_spec = importlib.util.spec_from_file_location(
    "_kestrel_build", os.path.join(os.path.dirname(os.path.abspath(__file__)), "appliance", "native", "build.py"))
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)

setup(
    ext_modules=[
        Extension(
            "appliance.native._kestrel_native",
            sources=[os.path.relpath(s) for s in _build.SOURCES],
            depends=[os.path.relpath(p) for p in sorted(
                os.path.join("appliance", "native", "src", f) for f in os.listdir(os.path.join(
                    "appliance", "native", "src")))],
            extra_compile_args=_build.CFLAGS,
            extra_link_args=["-pthread"],
            optional=True,  # a failed compile leaves the numpy path, never a failed install
        )
    ],
)
