"""The process-wide switches tests flip for a block, always restored: the fused kernels
(``cpu.set_enabled``), the native preprocess (``native_prepare.set_enabled``: engines built inside the block)
and compat.py's private fast paths."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from embcore.base import compat
from embcore.kernels import cpu
from embcore.step import native_prepare as fast


@contextlib.contextmanager
def _switched(set_enabled: Callable[[bool], bool], enabled: bool) -> Iterator[None]:
    """``set_enabled(enabled)`` for the block, the previous setting restored after it."""
    previous = set_enabled(enabled)
    try:
        yield
    finally:
        set_enabled(previous)


def kernels(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """``cpu.set_enabled(enabled)`` for the block."""
    return _switched(cpu.set_enabled, enabled)


def private_paths(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """``compat.set_private_fast_paths(enabled)`` for the block."""
    return _switched(compat.set_private_fast_paths, enabled)


def fast_path(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """``native_prepare.set_enabled(enabled)`` for the block (it applies to engines built inside it)."""
    return _switched(fast.set_enabled, enabled)
