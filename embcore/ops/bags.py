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

import torch

from ..kernels import cpu


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

    @cached_property
    def bag_of(self) -> torch.Tensor:
        """(nnz,) int64, the output row (bag) of each occurrence."""
        if self.offsets is None:
            return torch.arange(self.ids.numel(), device=self.ids.device)
        return bag_index(self.offsets, self.ids.numel())


def bag_index(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """(nnz,) int64: the bag of every occurrence of (R + 1,) int64 ``offsets`` (valid ones)."""
    if cpu.usable(offsets) and offsets.is_contiguous():
        return cpu.bag_of(offsets, nnz)
    lengths = offsets[1:] - offsets[:-1]  # (R,)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths,
                                   output_size=nnz)


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


def dedup(ids: torch.Tensor) -> Dedup:
    """One stable sort of ``ids`` (the torch-ops form of ``concat_dedup``)."""
    sorted_ids, order = torch.sort(ids, stable=True)  # (nnz,), (nnz,)
    unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)  # (U,), (U,)
    unique_offsets = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=unique_offsets[1:])
    return Dedup(unique, order, unique_offsets)


def concat_dedup(parts: list[torch.Tensor], adds: list[int],
                 num_rows: int | None) -> tuple[torch.Tensor, Dedup]:
    """Concatenates ``parts[i] + adds[i]`` and deduplicates the result.

    Args:
        parts: (nnz_i,) int64 ids of each feature.
        adds: the row offset added to each part (its table's first row in the physical table).
        num_rows: an upper bound of the shifted ids (>= 0); None for raw ids (any int64).

    Returns:
        ``(ids (nnz,), dedup)``. On the CPU the fused kernels do it in one call: row ids by
        a radix sort (it needs the bound), raw ids by hashing (their distinct ids then come in
        order of first occurrence, and the inverse comes with them).
    """
    usable = cpu.usable(*parts)
    if num_rows is not None and usable:
        got = cpu.concat_dedup([t.contiguous() for t in parts], adds, num_rows)
        assert not isinstance(got, int)  # (no limits: always a result)
        ids, unique, order, uoff = got
        return ids, Dedup(unique, order, uoff)
    shifted = [t + a if a else t for t, a in zip(parts, adds)]
    ids = torch.cat(shifted) if len(shifted) > 1 else shifted[0]  # (nnz,)
    if usable:  # raw ids
        ids = ids.contiguous()
        unique, inverse, order, uoff = cpu.dedup_raw(ids)
        dd = Dedup(unique, order, uoff)
        dd.__dict__["inverse"] = inverse  # the cached_property's value, known already
        return ids, dd
    return ids, dedup(ids)
