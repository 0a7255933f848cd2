"""The kernels' bindings: the fused CPU kernels (C++ loaded with ctypes) and the Triton kernels,
each declared once with the checks of its arguments."""
