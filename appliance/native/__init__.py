"""Native kernels (C, loaded with ctypes) and their numpy twins.

Policy: every C entry point has a numpy twin with the same name and argument order (dequant_numpy,
twins); tests compare them. The numpy path always works: if the compiled library is missing, fails to
load, or KESTREL_NATIVE=0, `kernels.available()` is False and callers use the twins or plain numpy.
"""
