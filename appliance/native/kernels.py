"""Placeholder until the C library lands: no native kernels."""


def available() -> bool:
    return False
