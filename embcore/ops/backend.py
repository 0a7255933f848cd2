"""The backend of a device: which kernels run the step's work there, chosen once.

Three backends, as TorchRec names a table's compute kernel:

- ``"fused CPU"``: the C kernels of ``kernels/cpu/`` (a CPU device where they build and are
  switched on: ``cpu.available()``);
- ``"Triton"``: the Triton kernels of ``kernels/gpu/`` (a CUDA device where triton imports; in
  tests, CPU tensors under Triton's interpreter, ``gpu.force_on_cpu``);
- ``"torch ops"``: torch ops alone, the portable path on any device.

``choose(device)`` is the one rule. The engine asks it when it is made (``print(plan)`` shows the
answer) and when its tables move (``Embedding.to``); the rows builder (state/build.py) hands the
plan's backend to every rows object, raw-id map and cache it makes, and none of them asks again: a
table's kernels are bound once (``TableCombine``, ``TableUpdate``), its map is the backend's kind
(``vocab_map`` of state/vocab/vocabulary.py, the one factory) and its cache's index lives where the
backend runs (docs/semantics.md section 16). A switch of the kernels (``cpu.set_enabled``) applies
to the engines made after it.

A backend is also the object its callers ask for the batch's work, so that none checks where a
tensor lies or which kernels are built: the input checks (``minmax``, ``offsets_error``,
``strictly_increasing``), the combiner's scales and each id's bag (``combiner_scales``,
``bag_index``), the dedup (``dedup``, ``dedup_runs``) and the moves of rows (``copy_rows``,
``move_summed``, with the slow tier's checksums). ``Backend`` itself is the torch ops; the fused
CPU backend overrides each verb with its kernel; the Triton backend's kernels are bound per table
(ops/combine.py, ops/update.py) and its batch verbs are the torch ops. Inside a call only what
truly varies per call is checked: a call that a tracer must see (``torch.export``,
``torch.compile``) takes the torch ops, on every backend. The host's own work beside a device
(the slow tier's files and its index) runs on ``backend.host()``.

>>> choose(torch.device("meta")).name
'torch ops'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from ..kernels import cpu, gpu
from .bags import Dedup, bag_index, combiner_scales, dedup
from .checksum import move_summed_fused, move_summed_torch

Name = Literal["fused CPU", "Triton", "torch ops"]
NAMES: tuple[Name, ...] = ("fused CPU", "Triton", "torch ops")


class Backend:
    """A device's backend (see the module's docstring): the torch ops, which the other two
    backends specialize.

    Attributes:
        name: ``"fused CPU"``, ``"Triton"`` or ``"torch ops"``.
        fused_cpu: whether the fused CPU kernels run the work (kernels/cpu/).
        triton: whether the Triton kernels run the work (kernels/gpu/).
    """

    name: Name = "torch ops"
    fused_cpu = False
    triton = False

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"

    def host(self) -> Backend:
        """The backend of the host's work beside this device (the slow tier's files and index:
        host memory): this one, except beside a GPU, where the fused CPU kernels run it if
        they are available."""
        return self

    # ---- input checks: each reads a value back, by design (docs/semantics.md section 2)

    def minmax(self, ids: torch.Tensor) -> tuple[int, int]:
        """``(min, max)`` of non-empty int64 ``ids``."""
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one host sync
        return int(lo), int(hi)

    def bounds(self, ids: torch.Tensor) -> torch.Tensor:
        """(2,) int64 ``[min, max]`` of non-empty ``ids``, where they are (not read back)."""
        return torch.stack(torch.aminmax(ids))

    def id_bounds(self, parts: Sequence[torch.Tensor], vocabs: Sequence[int],
                  flags: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """((F + 2 N,) int64: the F one-value ``flags`` of the batch's other checks, 0 good,
        then ``[min, max]`` of each of the N non-empty int64 ``parts``, where they are; the
        verdict, () int64 nonzero where a flag is or an id of part i is outside
        ``[0, vocabs[i])``, when computed in the same launch, else None: inputs/canonical.py's
        ``Verdicts`` judges the report)."""
        return torch.stack([*(f.reshape(()).to(torch.int64) for f in flags),
                            *(b for t in parts for b in torch.aminmax(t))]), None

    def offsets_error(self, offsets: torch.Tensor, nnz: int) -> int:
        """-1 when (B + 1,) int64 ``offsets`` start at 0, never decrease and end at ``nnz``;
        else the first entry breaking that (0: the first is not 0; i: ``offsets[i] <
        offsets[i - 1]``; B: the last is not ``nnz``)."""
        falls = offsets[1:] < offsets[:-1]  # (B,)
        first, fall, last = torch.stack([offsets[0] != 0, falls.any(),
                                         offsets[-1] != nnz]).tolist()  # one host sync
        n = offsets.numel()
        return 0 if first else (int(falls.nonzero()[0]) + 1 if fall else (n - 1 if last else -1))

    def offsets_verdict(self, offsets: torch.Tensor, nnz: int, mean: bool = False
                        ) -> tuple[torch.Tensor, int | torch.Tensor]:
        """``(offsets to use, verdict)`` on (B + 1,) int64 ``offsets`` without waiting: the
        verdict a 0-d tensor, nonzero when they are malformed (``offsets_error`` then names the
        entry), and the offsets made safe to index with meanwhile (in [0, ``nnz``], never
        decreasing, 0 first and ``nnz`` last: the given ones when they are valid). ``mean``: the
        caller will ask ``combiner_scales`` for the mean of their unweighted bags (a backend may
        compute it now)."""
        safe = torch.cummax(offsets.clamp(0, nnz), 0).values  # (B + 1,)
        safe[0] = 0
        safe[-1] = nnz
        return safe, (safe != offsets).any()

    def strictly_increasing(self, indices: torch.Tensor, shape: tuple[int, ...]) -> bool:
        """Whether the columns of (k, nnz >= 2) contiguous int64 COO indices, in range of
        ``shape``, strictly increase (sorted, no duplicates)."""
        # In-range indices: lexicographic order is the order of the linearized index.
        strides = torch.tensor([math.prod(shape[i + 1:]) for i in range(len(shape))],
                               dtype=torch.int64, device=indices.device)
        lin = (indices * strides[:, None]).sum(0)  # (nnz,)
        return not bool((lin[1:] <= lin[:-1]).any())

    # ---- the batch

    def concat_offsets(self, parts: Sequence[torch.Tensor], shifts: Sequence[int], total: int
                       ) -> torch.Tensor:
        """Jagged offsets as one: ((sum of B_i) + 1,) int64, each part's (B_i + 1,) offsets but
        its last plus ``shifts[i]`` (the ids before it), then ``total``."""
        cut = [p[:-1] + a if a else p[:-1] for p, a in zip(parts, shifts)]
        cut.append(torch.tensor([total], dtype=torch.int64, device=parts[0].device))
        return cpu.concat(cut)

    def combiner_scales(self, offsets: torch.Tensor, weights: torch.Tensor | None,
                        combiner: str, nnz: int, seg: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """``ops.bags.combiner_scales``: (nnz,) float32 per-id scales applying the combiner."""
        return combiner_scales(offsets, weights, combiner, nnz, seg)

    def bag_index(self, offsets: torch.Tensor, nnz: int) -> torch.Tensor:
        """(nnz,) int64: the bag of every occurrence of valid (R + 1,) int64 ``offsets``."""
        return bag_index(offsets, nnz)

    def dedup(self, parts: Sequence[torch.Tensor], adds: Sequence[int],
              num_rows: int | None, padded: bool = False) -> tuple[torch.Tensor, Dedup]:
        """Concatenates ``parts[i] + adds[i]`` ((nnz_i,) int64 ids of each feature, shifted by
        its table's first row) and deduplicates the result: ``(ids (nnz,), dedup)``.
        ``num_rows``: an upper bound of the shifted ids, or None for raw ids (any int64).
        ``padded``: the caller's kernels take a dedup of fixed capacity (``bags.dedup_padded``),
        which the Triton backend then gives (its size read back from no value)."""
        shifted = [t + a if a else t for t, a in zip(parts, adds)]
        ids = torch.cat(shifted) if len(shifted) > 1 else shifted[0]  # (nnz,)
        return ids, dedup(ids)

    def dedup_runs(self, parts: Sequence[torch.Tensor], runs: Sequence[int]
                   ) -> tuple[torch.Tensor, Dedup, list[int]] | None:
        """Raw ids deduplicated per run of ``runs[k]`` consecutive parts, in one call:
        ``(ids, dedup, distinct ids per run)``; None where the backend has no such call (the
        caller deduplicates each run with ``dedup``)."""
        return None

    # ---- rows

    def copy_rows(self, src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
                  dst_rows: torch.Tensor) -> None:
        """``dst[dst_rows] = src[src_rows]`` for 2-D ``src`` / ``dst`` of one dtype, rows
        contiguous (any row stride: a field of a file's records), on any devices; (n,) int64
        row indices."""
        dst.index_copy_(0, dst_rows.to(dst.device),
                        src.index_select(0, src_rows.to(src.device)).to(dst.device))

    def move_summed(self, src: Sequence[torch.Tensor], src_rows: torch.Tensor,
                    dst: Sequence[torch.Tensor] | None, dst_rows: torch.Tensor | None,
                    keys: torch.Tensor, sums: torch.Tensor, verify: bool,
                    versions: torch.Tensor | None = None) -> int:
        """Moves rows with their checksums (``ops.checksum.move_summed_torch``, whose
        contract it is): -1, or the first row whose checksum differs."""
        return move_summed_torch(src, src_rows, dst, dst_rows, keys, sums, verify, versions)


def _traced() -> bool:
    """Whether torch.export / torch.compile is tracing the call (its tensors have no data: the
    torch ops run, on every backend)."""
    return torch.compiler.is_compiling()


class _FusedCPU(Backend):
    """The fused CPU kernels (kernels/cpu/): every tensor of a call is a CPU tensor."""

    name: Name = "fused CPU"
    fused_cpu = True

    def minmax(self, ids: torch.Tensor) -> tuple[int, int]:
        return cpu.minmax(ids.contiguous())

    def bounds(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor(cpu.minmax(ids.contiguous()))

    def offsets_error(self, offsets: torch.Tensor, nnz: int) -> int:
        return cpu.offsets_error(offsets.contiguous(), nnz)

    def offsets_verdict(self, offsets: torch.Tensor, nnz: int, mean: bool = False
                        ) -> tuple[torch.Tensor, int | torch.Tensor]:
        return offsets, cpu.offsets_error(offsets.contiguous(), nnz)  # (known at once)

    def strictly_increasing(self, indices: torch.Tensor, shape: tuple[int, ...]) -> bool:
        return cpu.first_unordered(indices.contiguous()) < 0

    def combiner_scales(self, offsets: torch.Tensor, weights: torch.Tensor | None,
                        combiner: str, nnz: int, seg: torch.Tensor | None = None
                        ) -> torch.Tensor:
        if _traced():
            return combiner_scales(offsets, weights, combiner, nnz, seg)
        return cpu.combiner_scales(offsets.contiguous(),
                                   None if weights is None else weights.contiguous(),
                                   combiner, nnz)

    def bag_index(self, offsets: torch.Tensor, nnz: int) -> torch.Tensor:
        if _traced():
            return bag_index(offsets, nnz)
        return cpu.bag_of(offsets.contiguous(), nnz)

    def dedup(self, parts: Sequence[torch.Tensor], adds: Sequence[int],
              num_rows: int | None, padded: bool = False) -> tuple[torch.Tensor, Dedup]:
        """On the kernels in one call: row ids by a radix sort (it needs the bound), raw ids by
        hashing (their distinct ids then come in order of first occurrence, and the inverse
        comes with them)."""
        if _traced():
            return super().dedup(parts, adds, num_rows)
        if num_rows is not None:
            got = cpu.concat_dedup([t.contiguous() for t in parts], adds, num_rows)
            assert not isinstance(got, int)  # (no limits: always a result)
            ids, unique, order, uoff = got
            return ids, Dedup(unique, order, uoff)
        shifted = [t + a if a else t for t, a in zip(parts, adds)]
        ids = (torch.cat(shifted) if len(shifted) > 1 else shifted[0]).contiguous()  # (nnz,)
        unique, inverse, order, uoff = cpu.dedup_raw(ids)
        dd = Dedup(unique, order, uoff)
        dd.__dict__["inverse"] = inverse  # the cached_property's value, known already
        return ids, dd

    def dedup_runs(self, parts: Sequence[torch.Tensor], runs: Sequence[int]
                   ) -> tuple[torch.Tensor, Dedup, list[int]] | None:
        if _traced():
            return None
        ids, unique, inverse, order, uoff, counts = cpu.dedup_raw_runs(
            [t.contiguous() for t in parts], runs)
        dd = Dedup(unique, order, uoff)
        dd.__dict__["inverse"] = inverse  # (the cached_property's value, known)
        return ids, dd, counts

    def copy_rows(self, src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
                  dst_rows: torch.Tensor) -> None:
        cpu.copy_rows(src, src_rows.contiguous(), dst, dst_rows.contiguous())

    def move_summed(self, src: Sequence[torch.Tensor], src_rows: torch.Tensor,
                    dst: Sequence[torch.Tensor] | None, dst_rows: torch.Tensor | None,
                    keys: torch.Tensor, sums: torch.Tensor, verify: bool,
                    versions: torch.Tensor | None = None) -> int:
        return move_summed_fused(src, src_rows, dst, dst_rows, keys, sums, verify, versions)


class _Triton(Backend):
    """The Triton kernels (kernels/gpu/), bound per table; the batch verbs are torch ops, or
    kernels/gpu/batch.py's launches where one replaces several (the ids' bounds, the dedup of
    fixed capacity)."""

    name: Name = "Triton"
    triton = True

    def host(self) -> Backend:
        return host()

    def dedup(self, parts: Sequence[torch.Tensor], adds: Sequence[int],
              num_rows: int | None, padded: bool = False) -> tuple[torch.Tensor, Dedup]:
        """Row ids for kernels that take it deduplicated with a fixed capacity
        (``bags.dedup_padded``'s results, no synchronisation: the parts concatenated and
        shifted in one launch, a stable sort, the runs in one launch); else the torch ops'."""
        if not padded or num_rows is None or _traced():
            return super().dedup(parts, adds, num_rows)
        if len(parts) == 1:
            ids = parts[0] + adds[0] if adds[0] else parts[0]  # (nnz,)
        else:  # the parts concatenated and shifted in one launch
            ids = gpu.concat_shift(list(parts), list(adds))  # (nnz,)
        # ``dedup_padded``'s: a stable sort, then its runs in one launch
        sorted_ids, order = torch.sort(ids, stable=True)  # (nnz,), (nnz,)
        unique, unique_offsets = gpu.dedup_runs(sorted_ids)  # (nnz,), (nnz + 1,)
        return ids, Dedup(unique, order, unique_offsets)

    def id_bounds(self, parts: Sequence[torch.Tensor], vocabs: Sequence[int],
                  flags: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The report and the verdict in one launch (``gpu.id_bounds``)."""
        if _traced():
            return super().id_bounds(parts, vocabs, flags)
        return gpu.id_bounds(list(parts), list(vocabs), list(flags))

    def offsets_verdict(self, offsets: torch.Tensor, nnz: int, mean: bool = False
                        ) -> tuple[torch.Tensor, int | torch.Tensor]:
        """The torch ops' answer in one launch (``gpu.jagged_offsets``), which with ``mean``
        also gives the mean scales of unweighted bags over the safe offsets, kept for
        ``combiner_scales``."""
        if _traced():
            return super().offsets_verdict(offsets, nnz)
        safe, verdict, means = gpu.jagged_offsets(offsets, nnz, mean)
        if mean:
            means_of = self._means
            if len(means_of) >= 256:  # (never asked for: a batch that failed its checks)
                means_of.clear()
            means_of[id(safe)] = (safe, means)
        return safe, verdict

    def combiner_scales(self, offsets: torch.Tensor, weights: torch.Tensor | None,
                        combiner: str, nnz: int, seg: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """The torch ops' scales; a mean over unweighted bags whose offsets ``offsets_verdict``
        made safe: the scales it computed with them (the same bits: each bag's ``1 / length``,
        one correctly rounded division)."""
        if combiner == "mean" and weights is None and seg is None:
            kept = self._means.pop(id(offsets), None)
            if kept is not None and kept[0] is offsets:
                return kept[1]
        return combiner_scales(offsets, weights, combiner, nnz, seg)

    def bag_index(self, offsets: torch.Tensor, nnz: int) -> torch.Tensor:
        """The torch ops' result in one launch (``gpu.bag_index``)."""
        if _traced():
            return bag_index(offsets, nnz)
        return gpu.bag_index(offsets, nnz)

    def concat_offsets(self, parts: Sequence[torch.Tensor], shifts: Sequence[int], total: int
                       ) -> torch.Tensor:
        """The torch ops' result in one launch (``gpu.concat_offsets``)."""
        if _traced() or min(p.numel() for p in parts) == 0:
            return super().concat_offsets(parts, shifts, total)
        return gpu.concat_offsets(list(parts), list(shifts), total)

    def __init__(self) -> None:
        # the mean scales ``offsets_verdict`` computed, by the safe offsets' id (with them)
        self._means: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


FUSED_CPU: Backend = _FusedCPU()
TRITON: Backend = _Triton()
TORCH_OPS: Backend = Backend()


def choose(device: torch.device | str) -> Backend:
    """The backend of ``device``: the fused CPU kernels on a CPU where they are built and
    switched on, Triton where its kernels apply to the device's tensors, else torch ops."""
    device = torch.device(device)
    if device.type == "cpu" and not gpu.usable(torch.empty(0)) and cpu.available():
        return FUSED_CPU
    if device.type != "meta" and gpu.usable(torch.empty(0, device=device)):
        return TRITON
    return TORCH_OPS


def host() -> Backend:
    """The backend of work on host memory beside any device (the slow tier beside a GPU, a
    profile of batches): the fused CPU kernels where they are available, else torch ops."""
    return FUSED_CPU if cpu.available() else TORCH_OPS


def named(name: str) -> Backend:
    """The backend called ``name`` (one of ``NAMES``)."""
    if name not in NAMES:
        raise ValueError(f"backend {name!r}: expected one of {NAMES}")
    return {b.name: b for b in (FUSED_CPU, TRITON, TORCH_OPS)}[name]
