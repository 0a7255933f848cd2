"""The one batch type of the step: weighted bags of ids (``Bags``) and their deduplication.

Every input, whatever its kind, becomes ``Bags``: ``R`` output rows, row ``r`` being
``sum_k scales[k] * E[ids[k]]`` over ``k in [offsets[r], offsets[r+1])``. A feature's batch is one
``Bags`` (inputs/canonical.py); the features reading one physical table are concatenated into
one ``Bags`` (step/preprocess.py) and deduplicated once (``Dedup``). The lookup and its gradient
(ops/combine.py) and the fused update (ops/update.py) read only these two types.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch


class _BagIndexing(Protocol):
    """What ``Bags.bag_of`` asks of a backend (ops/backend.py ``Backend``, which imports this
    module)."""

    def bag_index(self, offsets: torch.Tensor, nnz: int) -> torch.Tensor: ...


@dataclass
class Bags:
    """A weighted bag lookup of ``R = prod(shape)`` output rows.

    ``offsets`` and ``scales`` are both None when every row is one id with scale 1 (``unit``: a
    plain gather; they would be ``arange(nnz + 1)`` and ``ones(nnz)``).

    Made every step, so a plain dataclass rather than a frozen one (whose generated ``__init__``
    sets each field through ``object.__setattr__``: with the step's other records, about 2 us a
    step on W3-B16); as ``Dedup`` and step/preprocess.py's records, never written once made.
    """

    ids: torch.Tensor              # (nnz,) int64 row of each occurrence
    offsets: torch.Tensor | None   # (R + 1,) int64 bag boundaries; None when unit
    scales: torch.Tensor | None    # (nnz,) float32 combiner scale times weight; None when unit
    shape: tuple[int, ...] = ()    # leading shape of the activation (without D)
    # () int64 on the device, the batch's verdict of its checks there (inputs/verdicts.py):
    # nonzero, the Triton kernels read and write no row of it; None: checked on the host
    verdict: torch.Tensor | None = None

    @property
    def unit(self) -> bool:
        return self.offsets is None

    @property
    def num_rows(self) -> int:
        return self.ids.numel() if self.offsets is None else self.offsets.numel() - 1

    def offsets_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(offsets (R + 1,), scales (nnz,))``, materialized for unit bags."""
        if self.offsets is not None and self.scales is not None:
            return self.offsets, self.scales
        n = self.ids.numel()
        return (torch.arange(n + 1, dtype=torch.int64, device=self.ids.device),
                torch.ones(n, dtype=torch.float32, device=self.ids.device))

    def bag_of(self, backend: _BagIndexing) -> torch.Tensor:
        """(nnz,) int64, the output row (bag) of each occurrence (by ``backend``; kept)."""
        got: torch.Tensor | None = self.__dict__.get("_bag_of")
        if got is None:
            got = (torch.arange(self.ids.numel(), device=self.ids.device) if self.offsets is None
                   else backend.bag_index(self.offsets, self.ids.numel()))
            self.__dict__["_bag_of"] = got
        return got


def bag_index(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """(nnz,) int64: the bag of every occurrence of (R + 1,) int64 ``offsets`` (valid ones);
    torch ops (``Backend.bag_index``)."""
    lengths = offsets[1:] - offsets[:-1]  # (R,)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths,
                                   output_size=nnz)


def combiner_scales(offsets: torch.Tensor, weights: torch.Tensor | None, combiner: str,
                    nnz: int, seg: torch.Tensor | None = None) -> torch.Tensor:
    """Per-id scale so that a weighted sum over each bag applies the combiner (docs/semantics.md
    section 2).

    A bag whose weights sum (mean) or square-sum (sqrtn) to zero gets zero scales, not NaN.
    ``seg``: each id's bag when the caller has it; every size then follows from it, not from
    ``nnz`` (a sparse input's number of entries is not a traced size under torch.export).
    Torch ops (``Backend.combiner_scales``); the fused kernel gives the same bits.
    """
    w = weights if weights is not None else (
        torch.ones(nnz, dtype=torch.float32, device=offsets.device) if seg is None
        else torch.ones_like(seg, dtype=torch.float32))  # (nnz,)
    if combiner == "sum":
        return w
    if seg is None:
        seg = bag_index(offsets, nnz)  # (nnz,)
    per_bag = torch.zeros(offsets.numel() - 1, dtype=torch.float32, device=offsets.device)  # (R,)
    per_bag.index_add_(0, seg, w if combiner == "mean" else w * w)
    # sqrt in float64, then rounded: the correctly rounded float32 root, as the fused kernel's
    # std::sqrt (torch's float32 sqrt on the CPU can be 1 ulp off), so that an exported
    # program (these ops) gives the eager module's (the kernel's) bits
    denom = (per_bag if combiner == "mean" else per_bag.double().sqrt().float())[seg]  # (nnz,)
    # w / denom, not w * (1 / denom): the inverse of a tiny denominator overflows
    return torch.where(denom != 0, w / torch.where(denom != 0, denom, 1.0), 0.0)


@dataclass
class Dedup:
    """The distinct rows of a ``Bags`` and, per row, its occurrences in their original order.

    Sorting the occurrences stably by row gives ``order``; distinct row ``u`` is ``unique[u]`` and
    its occurrences are ``order[unique_offsets[u]:unique_offsets[u+1]]``. The gradient of a row
    is the scaled sum of its occurrences' output gradients in that order (deterministic). The
    raw ids of a dynamic table, deduplicated by hashing on the CPU, are in order of first
    occurrence instead of ascending (with the same grouping of occurrences).
    """

    unique: torch.Tensor          # (U,) int64 rows, ascending (raw ids: see above)
    order: torch.Tensor           # (nnz,) int64 occurrences sorted by row (stable)
    unique_offsets: torch.Tensor  # (U + 1,) int64 boundaries of each row's occurrences

    @cached_property
    def inverse(self) -> torch.Tensor:
        """(nnz,) int64, ``unique[inverse] == ids`` (to read rows fetched in unique order)."""
        counts = self.unique_offsets[1:] - self.unique_offsets[:-1]  # (U,)
        nnz = self.order.numel()
        rank = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device),
                                       counts, output_size=nnz)  # (nnz,) in sorted order
        inverse = torch.empty_like(self.order)
        inverse[self.order] = rank
        return inverse


_RANGE: dict[tuple[int, torch.device], torch.Tensor] = {}  # ``dedup_padded``'s last arange


def dedup_padded(ids: torch.Tensor) -> Dedup:
    """``dedup(ids)`` with sizes from the input alone, as FBGEMM's table-batched kernels: no
    value is read back (no ``unique_consecutive``, whose size is the data's). ``unique`` holds
    nnz entries and ``unique_offsets`` nnz + 1: the first U are ``dedup``'s, bit for bit; the
    rest pad them, each an empty run of occurrences (``unique_offsets[u] == nnz``) of the
    largest id. Kernels launched over all nnz rows skip a row with no occurrence
    (kernels/gpu/rows.py); only a caller that does may take these (step/preprocess.py)."""
    n = ids.numel()
    sorted_ids, order = torch.sort(ids, stable=True)  # (nnz,), (nnz,)
    rank = torch.zeros(n, dtype=torch.int64, device=ids.device)  # (nnz,) distinct row of each
    torch.cumsum(sorted_ids[1:] != sorted_ids[:-1], 0, out=rank[1:])
    key = (n, ids.device)
    steps = _RANGE.get(key)
    if steps is None:  # (kept: one arange a batch size, not an op a step)
        _RANGE.clear()
        steps = _RANGE[key] = torch.arange(n + 1, device=ids.device)  # (nnz + 1,)
    unique_offsets = torch.searchsorted(rank, steps)  # (nnz + 1,) first occurrence of each
    unique = sorted_ids[unique_offsets[:-1].clamp(max=max(n - 1, 0))]  # (nnz,)
    return Dedup(unique, order, unique_offsets)


def dedup(ids: torch.Tensor) -> Dedup:
    """One stable sort of ``ids``: torch ops (``Backend.dedup``)."""
    sorted_ids, order = torch.sort(ids, stable=True)  # (nnz,), (nnz,)
    unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)  # (U,), (U,)
    unique_offsets = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=unique_offsets[1:])
    return Dedup(unique, order, unique_offsets)
