"""Table memory: large CPU tables and slots on transparent huge pages; the slow tier's mapped
files without read-ahead.

A step touches rows spread over tables of hundreds of MB to GB: with 4 KiB pages nearly every
touched row is a TLB miss and a page walk. Asking Linux for 2 MiB pages (``madvise(MADV_HUGEPAGE)``)
before the table is first written covers 512 times more memory per TLB entry; on W1 that made the
fused update about a third faster (benchmarks/RESULTS.md). It is advice: where the kernel has
transparent huge pages off, or on other systems, nothing changes.

A cache of the slow tier is faulted in when it is made (``populate``), so that the steps that fill
it do not pay the kernel's zeroing of its pages one page fault at a time.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Literal

import torch

HUGE_PAGE = 1 << 21
MADV_RANDOM = 1
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+
MIN_BYTES = 8 * HUGE_PAGE  # smaller tensors gain little

_madvise: Callable[..., int] | Literal[False] | None = None  # False: libc has none


def _libc_madvise() -> Callable[..., int] | Literal[False] | None:
    global _madvise
    if _madvise is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    return _madvise


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Asks for huge pages under ``t``'s storage (whole 2 MiB pages inside it); True if accepted.

    Call it before the tensor is first written: pages already touched stay small.
    """
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or t.nbytes < MIN_BYTES:
        return False
    fn = _libc_madvise()
    if not fn:
        return False
    start = t.data_ptr()
    first = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (start + t.nbytes) & ~(HUGE_PAGE - 1)
    return end > first and fn(first, end - first, MADV_HUGEPAGE) == 0


def advise_random(t: torch.Tensor) -> bool:
    """Tells Linux that ``t``'s pages (a mapped file) are read in random order: no read-ahead.

    A page fault on a mapped file otherwise reads ahead up to hundreds of KiB around the page:
    the slow tier reads rows of a few hundred bytes at random places, and read-ahead multiplied
    its disk reads by over 100 (W4, benchmarks/RESULTS.md). True if accepted."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or t.nbytes == 0:
        return False
    fn = _libc_madvise()
    if not fn:
        return False
    page = 4096
    start = t.data_ptr() & ~(page - 1)
    return fn(start, t.data_ptr() + t.nbytes - start, MADV_RANDOM) == 0


def populate(t: torch.Tensor) -> bool:
    """Faults in every page under ``t`` (a CPU tensor) now, writable, its values unchanged:
    ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), else a write of each page's first byte with
    its own value. Memory never touched is otherwise zeroed by the kernel page by page at its
    first write, inside whatever step writes it first (a cache's rows while it fills; on a VM
    the host may be backing those pages for the first time too: 1 ms a step of 4 x 10M x 32,
    benchmarks/RESULTS.md). True if pages were faulted in."""
    if t.device.type != "cpu" or t.nbytes == 0:
        return False
    page = 4096
    start = t.data_ptr() & ~(page - 1)
    fn = _libc_madvise() if sys.platform.startswith("linux") else None
    if fn and fn(start, t.data_ptr() + t.nbytes - start, MADV_POPULATE_WRITE) == 0:
        return True
    b = t.detach().reshape(-1).view(torch.uint8) if t.is_contiguous() else None
    if b is None:
        return False
    first = (-t.data_ptr()) % page  # the first byte on a page boundary, then every page's
    head = b[:1]
    head.copy_(head.clone())  # (the first page, which may start before the boundary)
    pages = b[first::page]
    pages.copy_(pages.clone())
    return True


def empty_table(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape)`` for a table or slot, on huge pages where the system allows."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t
