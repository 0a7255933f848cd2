"""A slow tier written as a log: rows written back are appended, never rewritten in place.

The CPU slow tier of a static table is one mapped file of records (``cache.slow_records``: a
row and its slots side by side). Written back in place, every evicted row dirties the 4 KiB
page around its record, and under heavy misses the kernel's write-back of those scattered
pages throttles the process to the disk (full-size W2 at a 10% cache: 0.07x the in-memory
engine, benchmarks/RESULTS.md). ``RecordLog`` keeps the same file larger by ``SPARE`` and lets
a row's record live anywhere in it:

- ``where[row]`` is the place (record number) holding the row's current record, ``owner[place]``
  the row whose current record it holds (-1: free). A read of rows is a read at their places.
- Rows written back are gathered into a buffer and written at the **head**, in order, with
  ``pwrite`` (whole pages, none read first); their old places become free.
- The file is cut in **segments** (``SEGMENT`` records at most). When the head fills its
  segment it takes the one holding the fewest live records (``live``: greedy), and the
  **cleaner** first moves that segment's live records (rows not written since) to its front
  (read with one ``pread``), the head after them: the places ahead of it are then free.
- ``compact()`` puts row ``r`` back at place ``r`` for every row (blocks of at most the free
  places: the displaced records of a block go to free places after it, then its rows come home),
  so that the tier reads as a table again, rows in order, where the store hands it out whole
  (``RowStore.local``: checkpoints, loads, whole tables). A fresh log is compact.

Full-size W2 at a 10% cache (benchmarks/RESULTS.md): 3.8-5.4x the examples/s of writing back in
place, for 1.75x the records written (the cleaner's moves; 1.32x with ``SPARE`` 1.0, twice the
disk, for 7% less time). The values never change: a record moves whole, so a run behind a log
computes exactly what a run in memory computes.

The step's index work uses ``index_select`` / ``index_copy_`` / ``index_fill_``, not indexing
with a tensor (``where[rows] = ...``): on 2 busy cores a tensor index costs milliseconds whatever
its length (torch's parallel indexing waits for its threads), the ``index_*`` methods microseconds
on a segment's rows (benchmarks/RESULTS.md, the log's writes on 4 x 10M x 32).

Fast memory: ``where`` (4 bytes a row) and ``owner`` (4 bytes a place: 6 a row at ``SPARE``
0.5), int32 while the places fit (int64 beyond 2**31 places); the disk: ``1 + SPARE`` times the
records.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch

from ...ops.backend import Backend

SPARE = 0.5  # the file's places beyond its rows, as a share of them
SEGMENT = 4096  # records a segment holds at most (the cleaner's unit; 4 MiB of 1 KiB records)
MIN_SEGMENTS = 16  # a small table's segments are smaller: at least this many cover its rows


def places_for(rows: int) -> tuple[int, int]:
    """``(places, segment)``: the records a log of ``rows`` rows holds and its segment's
    records (``places`` a multiple of ``segment``, at least one segment more than ``rows``)."""
    segment = max(1, min(SEGMENT, -(-rows // MIN_SEGMENTS)))
    places = -(-max(math.ceil(rows * (1 + SPARE)), rows + segment) // segment) * segment
    return places, segment


class RecordLog:
    """The places of ``rows`` rows' records in ``raw`` (a ``(places, record)`` uint8 tensor of a
    mapped file, ``places_for(rows)[0]`` records), written through ``fd`` (the file's
    descriptor; None: through the mapping).

    Args:
        raw: the file's records (a ``cache.slow_tensor``: it holds the ``SlowFile``, whose
            descriptor ``fd`` is, open while ``raw`` lives).
        fd: the file, open for writing (``SlowFile.fd``), or None.
        rows: the rows it holds; row ``r`` starts at place ``r`` (a compact log).
        segment: records per segment (``places_for``).
    """

    def __init__(self, raw: torch.Tensor, fd: int | None, rows: int, segment: int) -> None:
        self.raw, self.fd, self.rows, self.segment = raw, fd, rows, segment
        self.places = raw.shape[0]
        self.record = raw.shape[1]
        if self.places % segment or self.places < rows + segment:
            raise ValueError(f"a log of {rows} rows in segments of {segment} needs a multiple "
                             f"of {segment} places beyond {rows + segment - 1}, got "
                             f"{self.places}")
        self.index_dtype = torch.int32 if self.places < 2**31 else torch.int64
        self.where = torch.empty(rows, dtype=self.index_dtype)
        self.owner = torch.empty(self.places, dtype=self.index_dtype)
        self.live = torch.empty(self.places // segment, dtype=torch.int64)  # records a segment
        self.written = 0  # records appended (rows written back)
        self.moved = 0    # records the cleaner moved
        self._buffer = torch.empty((0, self.record), dtype=torch.uint8)
        self._segment_buffer: torch.Tensor | None = None  # the cleaner's reads
        self._reset()

    def _reset(self) -> None:
        """The compact state: row ``r`` at place ``r``, the head at the first whole free
        segment."""
        torch.arange(self.rows, out=self.where)
        self.owner[:self.rows] = self.where
        self.owner[self.rows:] = -1
        self.live.zero_()
        self.live.index_add_(0, torch.arange(self.rows) // self.segment,
                             torch.ones(self.rows, dtype=torch.int64))
        self.head = -(-self.rows // self.segment) * self.segment % self.places
        self._cleaned: int | None = None  # the segment the head entered last
        self.compacted = True

    # ---------------------------------------------------------------- reads
    def at(self, rows: torch.Tensor) -> torch.Tensor:
        """(n,) int64: the places of rows ``rows`` (n,) int64."""
        if self.compacted:
            return rows
        return self.where.index_select(0, rows).to(torch.int64)

    # ---------------------------------------------------------------- writes
    def append(self, rows: torch.Tensor, sources: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
               backend: Backend, sums: torch.Tensor | None = None,
               versions: torch.Tensor | None = None) -> None:
        """Writes new records of distinct rows ``rows`` (k,) int64 at the head: the bytes of a
        record at offset ``o`` (a field) are those of ``source[at[i]]`` for each
        ``o: (source, at)`` of ``sources`` (a 2-D tensor with rows of the field's width and
        the (k,) int64 rows of it to take), moved by ``backend`` (the sources' device's). Their
        old records become free. With ``sums`` (the
        rows' checksums, (rows,) int32: ops/checksum.py), the rows' checksums are set there,
        summed from the records written (the fields in order, one ``at`` for all), keyed to
        the rows' ``versions`` ((k,) int32, or None: 0)."""
        k = rows.numel()
        if k == 0:
            return
        self.compacted = False
        rows = rows.to(torch.int64)
        old = self.where.index_select(0, rows).to(torch.int64)
        self.owner.index_fill_(0, old, -1)  # (their values are in ``sources``)
        self.live.index_add_(0, old // self.segment, torch.full_like(old, -1))
        data = self._staging(k)
        dst = torch.arange(k)
        if sums is not None:  # (one pass: the fields copied and summed)
            fields = list(sources.items())
            backend.move_summed(
                [source for _, (source, _) in fields], fields[0][1][1],
                [self._field(data, offset, source) for offset, (source, _) in fields],
                dst, rows, sums, False, versions)
        else:
            for offset, (source, at) in sources.items():
                view = self._field(data, offset, source)
                backend.copy_rows(source, at, view, dst)
        self._place(rows, data)
        self.written += k

    def _field(self, records: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
        """``records``' field at byte ``offset`` as a (n, width) tensor of ``like``'s dtype."""
        size = like.element_size()
        return records[:, offset:offset + like.shape[1] * size].view(like.dtype)

    def _staging(self, k: int) -> torch.Tensor:
        """A (k, record) uint8 buffer, kept across calls (the largest asked for)."""
        if self._buffer.shape[0] < k:
            self._buffer = torch.empty((k, self.record), dtype=torch.uint8)
        return self._buffer[:k]

    def _place(self, rows: torch.Tensor, data: torch.Tensor, cleaning: bool = False) -> None:
        """Writes records ``data`` (n, record) of rows ``rows`` (n,) from the head on (cleaning
        each segment it enters first, unless ``cleaning``)."""
        n, at = rows.numel(), 0
        while at < n:
            if not cleaning and self.head % self.segment == 0 and \
                    self.head // self.segment != self._cleaned:
                self._enter()
            k = min(n - at, self.segment - self.head % self.segment)
            self._write(self.head, data[at:at + k])
            chunk = rows[at:at + k]
            self.where.index_copy_(0, chunk, torch.arange(self.head, self.head + k,
                                                          dtype=self.index_dtype))
            self.owner[self.head:self.head + k] = chunk.to(self.index_dtype)
            self.live[self.head // self.segment] += k
            self.head = (self.head + k) % self.places
            at += k

    def _enter(self) -> None:
        """Takes the segment holding the fewest live records (the lowest such) for the head:
        its live records move to its front (the cleaner), the head after them. Greedy: on
        MovieLens-like skew (W2's Zipf 1.05) it moves fewer records than taking the segments in
        turn (benchmarks/RESULTS.md). The fewest is under a whole segment: the file has a
        segment of places more than its rows."""
        seg = int(torch.argmin(self.live))
        if int(self.live[seg]) >= self.segment:
            raise RuntimeError(f"the slow tier's log has no free place ({self.rows} rows in "
                               f"{self.places} places)")
        self.head, self._cleaned = seg * self.segment, seg
        a = seg * self.segment
        live = torch.nonzero(self.owner[a:a + self.segment] >= 0).flatten()
        if live.numel() == 0:
            return
        places = live + a
        rows = self.owner.index_select(0, places).to(torch.int64)
        data = self._read(a).index_select(0, live)  # (copied before the writes over them)
        self.owner.index_fill_(0, places, -1)
        self.live[seg] -= live.numel()
        self._place(rows, data, cleaning=True)
        self.moved += rows.numel()

    def _read(self, place: int) -> torch.Tensor:
        """(segment, record) records from ``place`` on: one ``pread`` of the whole segment
        (sequential: its pages may have left the page cache since the head wrote them, and
        faults would read them one by one), else the mapping."""
        if self.fd is None or not hasattr(os, "preadv"):
            return self.raw[place:place + self.segment]
        if self._segment_buffer is None:
            self._segment_buffer = torch.empty((self.segment, self.record), dtype=torch.uint8)
        view = self._segment_buffer.numpy().data.cast("B")
        offset, done = place * self.record, 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"the slow tier's log ended at byte {offset + done} (it holds "
                              f"{self.places * self.record})")
            done += got
        return self._segment_buffer

    def _write(self, place: int, data: torch.Tensor) -> None:
        """Records ``data`` at places ``place``.. (consecutive): one ``pwrite`` of whole pages
        where a descriptor is held (a store into a mapping that advises random reads would
        read each page from the disk first), else through the mapping."""
        if self.fd is None or not hasattr(os, "pwrite"):
            self.raw[place:place + data.shape[0]] = data
            return
        view = data.contiguous().numpy().data.cast("B")
        offset, done = place * self.record, 0
        while done < len(view):
            put = os.pwrite(self.fd, view[done:], offset + done)  # (OSError: the disk's error)
            if put <= 0:  # (the file's space is reserved: this would be a broken file system)
                raise OSError(f"the slow tier's log took no bytes at byte {offset + done} (it "
                              f"holds {self.places * self.record})")
            done += put

    # ---------------------------------------------------------------- outside the step
    def compact(self, host: Backend) -> None:
        """Puts row ``r``'s record at place ``r`` for every row: the file's first ``rows``
        records then read as the table, in row order (``RowStore.local``). ``host``: the
        backend of host memory, which moves the records."""
        if self.compacted:
            return
        free = self.places - self.rows
        for a in range(0, self.rows, free):
            b = min(self.rows, a + free)
            here = torch.arange(a, b, dtype=self.index_dtype)
            occupant = self.owner[a:b]
            # 1. records of other rows in [a, b) go to free places after it
            out = torch.nonzero((occupant >= 0) & (occupant != here)).flatten()
            if out.numel():
                to = torch.nonzero(self.owner[b:] < 0).flatten()[:out.numel()] + b
                self._move(out + a, to, host)
            # 2. the rows of [a, b) come home (each from a place after b: see above)
            away = torch.nonzero(self.owner[a:b] != here).flatten() + a
            if away.numel():
                self._move(self.where[away].to(torch.int64), away, host)
        self._reset()

    def _move(self, src: torch.Tensor, dst: torch.Tensor, host: Backend) -> None:
        """Moves the records at places ``src`` to free places ``dst`` (disjoint, int64)."""
        rows = self.owner[src].to(torch.int64)
        host.copy_rows(self.raw, src, self.raw, dst)
        self.owner[src] = -1
        self.owner[dst] = rows.to(self.index_dtype)
        self.where[rows] = dst.to(self.index_dtype)
        self.moved += rows.numel()
