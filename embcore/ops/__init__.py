"""Kernels: ``reference.py`` (readable loops, the oracle) and the fast paths beside it."""
