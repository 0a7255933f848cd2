"""The process-wide switches tests flip for a block, always restored: the fused kernels
(``native.set_enabled``), the dense path (``dense.set_enabled``: engines built inside the block)
and compat.py's private fast paths."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from embcore import compat, dense
from embcore.ops import native


@contextlib.contextmanager
def kernels(enabled: bool) -> Iterator[None]:
    """``native.set_enabled(enabled)`` for the block."""
    previous = native.set_enabled(enabled)
    try:
        yield
    finally:
        native.set_enabled(previous)


@contextlib.contextmanager
def private_paths(enabled: bool) -> Iterator[None]:
    """``compat.set_private_fast_paths(enabled)`` for the block."""
    previous = compat.set_private_fast_paths(enabled)
    try:
        yield
    finally:
        compat.set_private_fast_paths(previous)


@contextlib.contextmanager
def dense_path(enabled: bool) -> Iterator[None]:
    """``dense.set_enabled(enabled)`` for the block (it applies to engines built inside it)."""
    previous = dense.set_enabled(enabled)
    try:
        yield
    finally:
        dense.set_enabled(previous)
