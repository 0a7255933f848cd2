"""A streaming reader of Criteo click logs, in the TSV format exactly as published.

Each line of Criteo's Kaggle ``train.txt`` (Display Advertising Challenge) and of the Criteo 1TB
``day_0`` ... ``day_23`` files is 40 tab-separated fields:

    label \\t I1 ... I13 \\t C1 ... C26

- ``label``: ``0`` or ``1`` (clicked). Kaggle's ``test.txt`` has no label column: 39 fields.
- ``I1..I13``: integer counts, possibly empty (missing); Kaggle's ``I2`` has negative values
  (-1, -2, -3).
- ``C1..C26``: 32-bit categorical hashes written as 8 hex digits, possibly empty (missing).

Transforms (the usual DLRM / MLPerf ones):

- count ``x`` -> ``log(1 + max(x, 0))`` as float32. Negative counts are clipped to 0 before the
  log, as the DLRM reference preprocessing does: they occur in one feature only (Kaggle's I2,
  values down to -3), their meaning is undocumented, and ``log(1 + x)`` is undefined for
  ``x <= -1``. A missing count is 0 (so a missing count, a 0 and a negative one look alike).
- raw ids (the default): the hex value as an int64 (0 ... 2**32 - 1). A missing category is
  ``MISSING_ID = -1``, a value no hex field can take, so it is one more id of the feature with
  its own row in a dynamic table (``ec.DynamicVocabulary`` takes any int64).
- ``hash_buckets``: MLPerf-style modulo hashing into fixed tables: ``id % buckets[j]`` for
  feature ``j`` (one size for all features, or 26 sizes). A missing category is hashed as the
  value 0 (it lands in row 0, as in the DLRM preprocessing, where an empty field reads as 0).

Bad lines (a wrong field count, a count that is not a decimal integer, a category that is not
1 to 16 hex digits, a label that is not 0 or 1) raise ``DataError`` (a ``ValueError``) naming the
file and the 1-based line number; with ``skip_bad=True`` they are skipped and counted in
``ReadStats.skipped`` (the first few messages are kept in ``ReadStats.examples_of_bad``).

Reading streams: one line at a time through fixed-size numpy buffers, so files far larger than
memory are fine; ``.gz`` files are read through gzip. Only numpy and the standard library.

    from criteo.data import read_batches
    for batch in read_batches("train.txt", batch_size=4096):
        batch.dense      # (B, 13) float32
        batch.sparse     # (B, 26) int64
        batch.label      # (B,) float32, or None for an unlabeled file

Holding out a test share of a file that has no labeled test companion: ``holdout_every=k`` makes
every k-th line (line numbers k, 2k, ... counted over all lines, bad ones included) the test
part, the others the train part; ``part="train"`` / ``"test"`` reads one of them. Deterministic,
and it needs no second pass.
"""

from __future__ import annotations

import gzip
import io
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np

NUM_DENSE, NUM_SPARSE = 13, 26
DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
LABELED_FIELDS, UNLABELED_FIELDS = 1 + NUM_DENSE + NUM_SPARSE, NUM_DENSE + NUM_SPARSE  # 40, 39
MISSING_ID = -1  # raw-id mode: a missing category (no 8-hex-digit value is negative)
MISSING_HASHED_VALUE = 0  # hash mode: a missing category is hashed as the value 0
_HEX = frozenset("0123456789abcdefABCDEF")
_MAX_BAD_EXAMPLES = 5


class DataError(ValueError):
    """A malformed file: the message names the file and the line."""


class Batch(NamedTuple):
    dense: np.ndarray  # (B, 13) float32, log(1 + max(count, 0)), missing -> 0
    sparse: np.ndarray  # (B, 26) int64, raw ids (missing -1) or hashed rows
    label: np.ndarray | None  # (B,) float32 0/1, None for an unlabeled file


@dataclass
class ReadStats:
    """What a read saw; filled in as the batches are consumed."""

    lines: int = 0  # lines read (all parts, bad ones included)
    examples: int = 0  # examples yielded
    skipped: int = 0  # bad lines skipped (skip_bad=True)
    examples_of_bad: list[str] = field(default_factory=list)  # the first few bad-line messages
    labeled: bool | None = None  # whether the file has a label column


def open_text(path: str | Path) -> io.TextIOBase:
    """A text stream of ``path`` (gzip-compressed when it ends in ``.gz``)."""
    path = Path(path)
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="latin-1", newline="\n")
    return open(path, encoding="latin-1", newline="\n")


def detect_labeled(path: str | Path) -> bool:
    """True when the first non-empty line of ``path`` has 40 fields, False with 39.

    Raises:
        DataError: the file is empty or its first line has another field count.
    """
    with open_text(path) as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line:
                continue
            n = line.count("\t") + 1
            if n in (LABELED_FIELDS, UNLABELED_FIELDS):
                return n == LABELED_FIELDS
            raise DataError(f"{path}:{number}: {n} tab-separated fields, expected 40 (label, "
                            f"13 counts, 26 categories) or 39 (no label, as Kaggle's test.txt)")
    raise DataError(f"{path}: the file has no lines")


def has_labels(path: str | Path) -> bool:
    """Whether ``path`` has a label column (``detect_labeled``)."""
    return detect_labeled(path)


def bucket_sizes(hash_buckets: int | Sequence[int] | None) -> np.ndarray | None:
    """The 26 per-feature bucket counts of ``hash_buckets`` (one for all, or 26), or None."""
    if hash_buckets is None:
        return None
    sizes = ([int(hash_buckets)] * NUM_SPARSE if isinstance(hash_buckets, (int, np.integer))
             else [int(s) for s in hash_buckets])
    if len(sizes) == 1:
        sizes = sizes * NUM_SPARSE
    if len(sizes) != NUM_SPARSE or min(sizes) < 1:
        raise ValueError(f"hash_buckets must be one size >= 1 or 26 of them, got {hash_buckets}")
    return np.asarray(sizes, dtype=np.int64)


def _parse_line(fields: list[str], labeled: bool, dense_out: np.ndarray,
                sparse_out: np.ndarray) -> float:
    """Parses one line's fields into the two rows given; returns the label (nan if none).

    Raises ValueError with a message saying which field is wrong (the caller adds file:line).
    """
    label = math.nan
    offset = 0
    if labeled:
        if fields[0] not in ("0", "1"):
            raise ValueError(f"label {fields[0]!r} is not 0 or 1")
        label = float(fields[0])
        offset = 1
    for i in range(NUM_DENSE):
        x = fields[offset + i]
        if x:
            try:
                v = int(x)
            except ValueError:
                raise ValueError(f"count {DENSE_NAMES[i]} {x!r} is not an integer") from None
            if "_" in x or x != x.strip():
                raise ValueError(f"count {DENSE_NAMES[i]} {x!r} is not an integer")
            dense_out[i] = math.log1p(v) if v > 0 else 0.0
        else:
            dense_out[i] = 0.0
    offset += NUM_DENSE
    for j in range(NUM_SPARSE):
        c = fields[offset + j]
        if c:
            if len(c) > 16 or not _HEX.issuperset(c):
                raise ValueError(f"category {SPARSE_NAMES[j]} {c!r} is not 1 to 16 hex digits")
            v = int(c, 16)
            sparse_out[j] = v - (1 << 64) if v >= 1 << 63 else v  # int64 two's complement
        else:
            sparse_out[j] = MISSING_ID
    return label


def read_batches(path: str | Path, batch_size: int, *,
                 hash_buckets: int | Sequence[int] | None = None, skip_bad: bool = False,
                 labeled: bool | None = None, limit: int | None = None,
                 part: Literal["all", "train", "test"] = "all", holdout_every: int = 0,
                 stats: ReadStats | None = None, start_after: int = 0) -> Iterator[Batch]:
    """Streams ``path`` as batches of ``batch_size`` examples (the last one may be smaller).

    Args:
        path: a Criteo TSV file (``.gz`` allowed).
        batch_size: examples per batch, >= 1.
        hash_buckets: None for raw ids; else one bucket count or 26 (``id % buckets[j]``).
        skip_bad: skip malformed lines (counted in ``stats.skipped``) instead of raising.
        labeled: whether lines have the label column; None detects it from the first line
            (40 fields: labeled, 39: not). Every line must then have that field count.
        limit: read at most this many lines (counted over all lines, as ``holdout_every``).
        part, holdout_every: with ``holdout_every = k > 0``, line numbers divisible by k form
            the "test" part and the others the "train" part; ``part`` picks one ("all": both).
        stats: a ``ReadStats`` filled in while reading (``stats.lines``: the number of the
            last line read, so ``start_after=stats.lines`` continues after a yielded batch).
        start_after: skip lines 1 ... start_after unparsed (resuming a run mid-file).

    Yields:
        ``Batch(dense (B, 13) float32, sparse (B, 26) int64, label (B,) float32 or None)``.

    Raises:
        DataError: a malformed line (file and line number in the message), unless ``skip_bad``.
        ValueError: bad arguments.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if part not in ("all", "train", "test"):
        raise ValueError(f"part must be 'all', 'train' or 'test', got {part!r}")
    if part != "all" and holdout_every < 2:
        raise ValueError(f"part={part!r} needs holdout_every >= 2, got {holdout_every}")
    buckets = bucket_sizes(hash_buckets)
    stats = stats if stats is not None else ReadStats()
    if labeled is None:
        labeled = detect_labeled(path)
    stats.labeled = labeled
    expected = LABELED_FIELDS if labeled else UNLABELED_FIELDS

    dense = np.zeros((batch_size, NUM_DENSE), dtype=np.float32)  # (B, 13)
    sparse = np.zeros((batch_size, NUM_SPARSE), dtype=np.int64)  # (B, 26)
    label = np.zeros(batch_size, dtype=np.float32)  # (B,)
    n = 0

    def emit(rows: int) -> Batch:
        s = sparse[:rows].copy()
        if buckets is not None:
            s[s == MISSING_ID] = MISSING_HASHED_VALUE
            s %= buckets  # (B, 26); numpy's % is >= 0 for positive buckets
        return Batch(dense[:rows].copy(), s, label[:rows].copy() if labeled else None)

    with open_text(path) as f:
        for number, line in enumerate(f, 1):
            if limit is not None and number > limit:
                break
            stats.lines = number
            if number <= start_after:
                continue
            if holdout_every > 0 and part != "all":
                if (number % holdout_every == 0) != (part == "test"):
                    continue
            fields = line.rstrip("\r\n").split("\t")
            try:
                if len(fields) != expected:
                    raise ValueError(
                        f"{len(fields)} tab-separated fields, expected {expected} ("
                        + ("label, 13 counts, 26 categories" if labeled else
                           "13 counts, 26 categories: the file's first line has no label")
                        + ")")
                label[n] = _parse_line(fields, labeled, dense[n], sparse[n])
            except ValueError as e:
                message = f"{path}:{number}: {e}"
                if not skip_bad:
                    raise DataError(message + " (skip_bad / --skip-bad skips such lines)") \
                        from None
                stats.skipped += 1
                if len(stats.examples_of_bad) < _MAX_BAD_EXAMPLES:
                    stats.examples_of_bad.append(message)
                continue
            n += 1
            if n == batch_size:
                stats.examples += n
                yield emit(n)
                n = 0
    if n:
        stats.examples += n
        yield emit(n)


def read_all(path: str | Path, **kwargs) -> Batch:
    """The whole of ``path`` (or its part) as one Batch: small files and tests only."""
    parts = list(read_batches(path, 65536, **kwargs))
    if not parts:
        labeled = kwargs.get("labeled")
        return Batch(np.zeros((0, NUM_DENSE), np.float32), np.zeros((0, NUM_SPARSE), np.int64),
                     np.zeros(0, np.float32) if labeled is not False else None)
    return Batch(np.concatenate([p.dense for p in parts]),
                 np.concatenate([p.sparse for p in parts]),
                 None if parts[0].label is None else np.concatenate([p.label for p in parts]))


def count_distinct(path: str | Path, **kwargs) -> np.ndarray:
    """Distinct ids per feature over the (part of the) file read: (26,) int64. One whole pass;
    memory grows with the distinct ids (8 bytes each), not with the file."""
    seen: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(NUM_SPARSE)]
    pending: list[list[np.ndarray]] = [[] for _ in range(NUM_SPARSE)]
    for i, batch in enumerate(read_batches(path, 65536, **kwargs)):
        for j in range(NUM_SPARSE):
            pending[j].append(np.unique(batch.sparse[:, j]))
        if i % 16 == 15:
            for j in range(NUM_SPARSE):
                seen[j] = np.unique(np.concatenate([seen[j], *pending[j]]))
                pending[j] = []
    for j in range(NUM_SPARSE):
        seen[j] = np.unique(np.concatenate([seen[j], *pending[j]]))
    return np.asarray([s.size for s in seen], dtype=np.int64)
