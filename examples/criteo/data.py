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
- raw ids (the default): the hex value as an int64: 0 ... 2**32 - 1 for Criteo's 8 hex digits.
  The reader takes 1 to 16 hex digits (either case) whose value is at most ``MAX_ID = 2**63 - 1``
  (7fffffffffffffff), so every id is a non-negative int64, and a missing category is
  ``MISSING_ID = -1``, a value no category can take: it is one more id of the feature with its
  own row in a dynamic table (``ec.DynamicVocabulary`` takes any int64), and no real value is
  merged with it. A category of 2**63 or more (e.g. ``ffffffffffffffff``, which as a 64-bit
  two's complement would be -1) is a bad line, not an id.
- ``hash_buckets``: MLPerf-style modulo hashing into fixed tables: ``id % buckets[j]`` for
  feature ``j`` (one size for all features, or 26 sizes). A missing category is hashed as the
  value 0 (it lands in row 0, as in the DLRM preprocessing, where an empty field reads as 0).

Bad lines (a wrong field count, a count that is not a decimal integer, a category that is not
1 to 16 hex digits or is above ``MAX_ID``, a label that is not 0 or 1) raise ``DataError`` (a
``ValueError``) naming the file and the 1-based line number; with ``skip_bad=True`` they are
skipped and counted in ``ReadStats.skipped`` (the first few messages are kept in
``ReadStats.examples_of_bad``).

A ``.gz`` file that is not gzip, or is truncated or corrupt, raises ``DataError`` naming the file
and the last line read before the damage (whatever ``skip_bad`` says: the rest of the file is
unreadable). The lines before it may have been yielded already, and the two parsers (below)
read ahead by different amounts, so they may stop at different lines there.

Reading streams, a block of about 4 MB of whole lines at a time, so files far larger than memory
are fine; ``.gz`` files are read through gzip. Only numpy and the standard library. Two parsers
give the same batches, errors and counts: ``parser="reference"``, one line at a time in plain
Python (``parse_line``: the specification, about 45k lines/s), and the default ``"fast"``, numpy
over whole blocks (about 8 times faster; examples/criteo/README.md has the measurements;
tests/test_criteo_data.py checks it against the reference on random lines, bad ones included,
and the lines it converts itself apart from those it hands to the reference).

    from criteo.data import read_batches
    for batch in read_batches("train.txt", batch_size=4096):
        batch.dense      # (B, 13) float32
        batch.sparse     # (B, 26) int64
        batch.label      # (B,) float32, or None for an unlabeled file

Holding out a test share of a file that has no labeled test companion: ``holdout_every=k`` makes
every k-th line (line numbers k, 2k, ... counted over all lines, bad ones included) the test
part, the others the train part; ``part="train"`` / ``"test"`` reads one of them. Deterministic,
and it needs no second pass.

Several processes: ``share=(rank, world)`` yields a process's share of every batch,
``batch[rank::world]``, and converts only those lines (each process still checks every line, so
all agree on the batches, on bad lines and on ``stats``).
"""

from __future__ import annotations

import functools
import gzip
import io
import math
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

NUM_DENSE, NUM_SPARSE = 13, 26
DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
LABELED_FIELDS, UNLABELED_FIELDS = 1 + NUM_DENSE + NUM_SPARSE, NUM_DENSE + NUM_SPARSE  # 40, 39
MAX_ID = 2**63 - 1  # raw-id mode: the largest category value read (larger ones are bad lines)
MISSING_ID = -1  # raw-id mode: a missing category (no category's id is negative)
MISSING_HASHED_VALUE = 0  # hash mode: a missing category is hashed as the value 0
_HEX = frozenset("0123456789abcdefABCDEF")
_MAX_BAD_EXAMPLES = 5
# What Python's gzip raises on a file that is not gzip, or is truncated or corrupt.
_GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)
_COUNT_BYTES = 1 << 24  # count_lines reads 16 MB at a time


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


def _gzip_error(path: str | Path, error: Exception, last_line: int) -> DataError:
    """The DataError of a .gz file that gzip cannot read on after line ``last_line``."""
    where = f"after line {last_line}" if last_line else "before its first line"
    kind = type(error).__name__
    if type(error).__module__ != "builtins":
        kind = f"{type(error).__module__}.{kind}"  # zlib.error, gzip.BadGzipFile
    return DataError(f"{path}: not a readable gzip file, or a truncated or corrupt one: reading "
                     f"stopped {where} ({kind}: {error})")


def _numbered_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """``path``'s lines (``open_text``) with their 1-based numbers.

    Raises:
        DataError: a .gz file that is not gzip, or is truncated or corrupt.
    """
    number = 0
    with open_text(path) as f:
        try:
            for number, line in enumerate(f, 1):
                yield number, line
        except _GZIP_ERRORS as e:
            raise _gzip_error(path, e, number) from None


def detect_labeled(path: str | Path) -> bool:
    """True when the first non-empty line of ``path`` has 40 fields, False with 39.

    Raises:
        DataError: the file is empty, its first line has another field count, or it is a .gz
            file that gzip cannot read (not gzip, truncated or corrupt) up to that line.
    """
    lines = _numbered_lines(path)
    try:
        for number, line in lines:
            line = line.rstrip("\r\n")
            if not line:
                continue
            n = line.count("\t") + 1
            if n in (LABELED_FIELDS, UNLABELED_FIELDS):
                return n == LABELED_FIELDS
            raise DataError(f"{path}:{number}: {n} tab-separated fields, expected 40 (label, "
                            f"13 counts, 26 categories) or 39 (no label, as Kaggle's test.txt)")
    finally:
        lines.close()  # closes the file now
    raise DataError(f"{path}: the file has no lines")


def has_labels(path: str | Path) -> bool:
    """Whether ``path`` has a label column (``detect_labeled``)."""
    return detect_labeled(path)


def count_lines(path: str | Path, *, limit: int | None = None,
                part: Literal["all", "train", "test"] = "all", holdout_every: int = 0,
                exact_up_to: int = 1 << 30) -> tuple[int, bool] | None:
    """How many lines ``read_batches(path, ..., limit=, part=, holdout_every=)`` reads, bad ones
    included (so its examples, but for skipped lines): for a progress bar's total.

    Returns ``(n, True)``, counted (the newlines, 16 MB at a time; a last line without one
    counts), when the file has at most ``exact_up_to`` bytes or ``limit`` lines are found
    first; ``(n, False)``, estimated from the file's size and its first 16 MB, for a larger
    file; None for a .gz file (its size says little) or a larger one with no newline in its
    first 16 MB.
    """
    path = Path(path)
    if path.suffix == ".gz":
        return None
    size = path.stat().st_size
    cap = math.inf if limit is None else limit
    lines, read, last = 0, 0, b"\n"
    exact = True
    with open(path, "rb") as f:
        while block := f.read(_COUNT_BYTES):
            lines += block.count(b"\n")
            read, last = read + len(block), block[-1:]
            if lines >= cap:
                break
            if size > exact_up_to:  # a big file: estimate from the first block
                if not lines:
                    return None
                lines, exact = round(lines * size / read), False
                break
        else:
            lines += last != b"\n"  # an unterminated last line
    lines = int(min(lines, cap))
    if holdout_every > 0 and part != "all":  # line numbers k, 2k, ... are the test part
        lines = lines // holdout_every if part == "test" else lines - lines // holdout_every
    return lines, exact


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


# ------------------------------------------------------------------------- the reference parser
# One line at a time in plain Python: the specification. The fast parser below must give
# exactly its examples, errors and counts (tests/test_criteo_data.py checks it on random lines).
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
            if v > MAX_ID:  # as an int64 it would be negative: -1 would merge with missing
                raise ValueError(f"category {SPARSE_NAMES[j]} {c!r} is above 7fffffffffffffff "
                                 f"(ids are int64s >= 0; {MISSING_ID} is a missing category)")
            sparse_out[j] = v
        else:
            sparse_out[j] = MISSING_ID
    return label


def parse_line(line: str, labeled: bool, dense_out: np.ndarray, sparse_out: np.ndarray
               ) -> float:
    """Parses one line (its line end included or not) into ``dense_out`` (13,) and
    ``sparse_out`` (26,); returns the label (nan for an unlabeled line).

    Raises:
        ValueError: the line is malformed; the message says which field (not file:line).
    """
    fields = line.rstrip("\r\n").split("\t")
    expected = LABELED_FIELDS if labeled else UNLABELED_FIELDS
    if len(fields) != expected:
        raise ValueError(f"{len(fields)} tab-separated fields, expected {expected} ("
                         + ("label, 13 counts, 26 categories" if labeled else
                            "13 counts, 26 categories: the file's first line has no label")
                         + ")")
    return _parse_line(fields, labeled, dense_out, sparse_out)


def _selected(number: Any, start_after: int, part: str, holdout_every: int) -> Any:
    """Whether line ``number`` (an int or an array of them) is read: after ``start_after`` and
    in ``part``."""
    keep = number > start_after
    if holdout_every > 0 and part != "all":
        keep = keep & ((number % holdout_every == 0) == (part == "test"))
    return keep


def _reference_batches(path: str | Path, batch_size: int, buckets: np.ndarray | None,
                       skip_bad: bool, labeled: bool, limit: int | None, part: str,
                       holdout_every: int, stats: ReadStats, start_after: int, rank: int,
                       world: int) -> Iterator[Batch]:
    """``read_batches`` one line at a time: the specification of what it yields and counts."""
    dense = np.zeros((batch_size, NUM_DENSE), dtype=np.float32)  # (B, 13)
    sparse = np.zeros((batch_size, NUM_SPARSE), dtype=np.int64)  # (B, 26)
    label = np.zeros(batch_size, dtype=np.float32)  # (B,)
    n = 0

    def emit(rows: int) -> Batch:
        share = slice(rank, rows, world)
        s = sparse[share].copy()
        if buckets is not None:
            s[s == MISSING_ID] = MISSING_HASHED_VALUE
            s %= buckets  # (B, 26); numpy's % is >= 0 for positive buckets
        return Batch(dense[share].copy(), s, label[share].copy() if labeled else None)

    lines = _numbered_lines(path)
    try:
        for number, line in lines:
            if limit is not None and number > limit:
                break
            stats.lines = number
            if not _selected(number, start_after, part, holdout_every):
                continue
            try:
                label[n] = parse_line(line, labeled, dense[n], sparse[n])
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
    finally:
        lines.close()  # closes the file now
    if n:
        stats.examples += n
        yield emit(n)


# ------------------------------------------------------------------------- the fast parser
# A block of whole lines at a time, as bytes (latin-1: one byte is one character), with numpy.
# Each field is read as one or two 8-byte words ending at its last character (big-endian, so
# its characters are the word's low bytes) and handled 8 characters at a time with integer
# arithmetic on the words ("SIMD within a register").
# 1. Every selected line is checked, so that all processes agree on which lines parse: its tab
#    count, that it holds only digits, hex digits, '-' and tabs (one bytes.translate), that its
#    '-' signs start counts, its label, that its counts hold digits only (at most 16) and that
#    its categories have at most 16 characters, the first of 16 being 0 ... 7 (<= MAX_ID).
# 2. Only the lines asked for are converted: counts from their digits, categories from their hex
#    digits, both by pairing neighbouring bytes of the words (a word: 8 characters -> 1 value).
# A line the checks cannot vouch for (a bad one, or a rare form such as a '+' sign, a count of
# more than 16 digits or a line ending in two '\r') goes through ``parse_line``: its values and
# its error message are the reference's by construction. Each block lists those lines
# (``_Block.handed_over``), so that tests check the fast parser's own conversions apart from
# them, and that nothing but bad lines and these rare forms is handed over.
_BLOCK_BYTES = 1 << 22  # about 17k lines of Criteo's
_PAD = 16  # bytes before a block, so that every field's two words start in the buffer
_ALLOWED = b"0123456789abcdefABCDEF-\t\n"
_LOG1P_TABLE = 1 << 16  # counts below this take log(1 + x) from a table


@dataclass
class _Block:
    """The selected lines of a stretch of the file: which parse (``good``, ascending line
    numbers) and which do not (``bad``: (number, message), ascending); ``rows(i)`` returns the
    values of ``good[i]`` (raw ids) and is only asked for the lines this process keeps.
    ``handed_over``: the lines the checks could not vouch for, which ``parse_line`` parsed (good
    or bad); the others' values are the fast parser's own (tests/test_criteo_data.py checks
    those against the reference, and that only bad lines and rare forms are handed over)."""

    last_line: int  # the number of the stretch's last line, selected or not
    good: np.ndarray  # (k,) int64
    bad: list[tuple[int, str]]
    rows: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
    handed_over: np.ndarray  # (h,) int64 line numbers, ascending


def _empty_rows(n: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.zeros((n, NUM_DENSE), np.float32), np.zeros((n, NUM_SPARSE), np.int64),
            np.zeros(n, np.float32))


def _u64(byte: int) -> np.uint64:
    return np.uint64(byte * 0x0101010101010101)  # the byte in all 8 lanes


_LOW_BYTES = np.array([(1 << 8 * i) - 1 for i in range(9)], np.uint64)  # (9,) low i bytes
_LOW_NIBBLES = np.array([(1 << 4 * i) - 1 for i in range(9)], np.uint64)  # (9,) low i nibbles


@functools.cache
def _log1p_table() -> np.ndarray:
    """(65536,) float32: log(1 + x) of x = 0 ... 65535, as math.log1p rounds it (the reference's
    arithmetic; numpy's log1p may differ from the C library's in the last bit)."""
    return np.array([0.0] + [math.log1p(x) for x in range(1, _LOG1P_TABLE)]).astype(np.float32)


def _log1p_counts(v: np.ndarray) -> np.ndarray:
    """log(1 + max(v, 0)) as float32, element by element exactly as ``math.log1p``."""
    out = _log1p_table()[np.clip(v, 0, _LOG1P_TABLE - 1)]
    big = v >= _LOG1P_TABLE
    if big.any():
        values, inverse = np.unique(v[big], return_inverse=True)
        out[big] = np.array([math.log1p(x) for x in values.tolist()]).astype(np.float32)[inverse]
    return out


def _byte_blocks(path: str | Path, size: int, prefix: bytes) -> Iterator[bytes]:
    """``prefix`` and then ``path``'s next whole lines, about ``size`` bytes of them at a time
    (an unterminated last line gets its newline), and 8 bytes of padding."""
    path = Path(path)
    with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
        rest = b""
        while chunk := f.read(size):
            cut = chunk.rfind(b"\n") + 1
            if cut == 0:
                rest += chunk
                continue
            yield b"".join((prefix, rest, memoryview(chunk)[:cut], b"0" * 8))
            rest = chunk[cut:]
        if rest:
            yield b"".join((prefix, rest, b"\n", b"0" * 8))


def _fast_blocks(path: str | Path, labeled: bool, limit: int | None, start_after: int,
                 part: str, holdout_every: int) -> Iterator[_Block]:
    first = 1  # the number of the block's first line
    bufs = _byte_blocks(path, _BLOCK_BYTES, prefix=b"0" * _PAD)
    while True:
        try:
            buf = next(bufs, None)
        except _GZIP_ERRORS as e:
            raise _gzip_error(path, e, first - 1) from None
        if buf is None:
            break
        a = np.frombuffer(buf, np.uint8)  # (S,) padding, whole lines, padding
        ends = np.flatnonzero(a == 10)  # (n,) each line's newline
        if limit is not None:
            ends = ends[:limit - first + 1]
        starts = np.concatenate([[_PAD], ends[:-1] + 1])  # (n,)
        numbers = np.arange(first, first + len(ends), dtype=np.int64)  # (n,)
        keep = _selected(numbers, start_after, part, holdout_every)
        yield _parse_block(buf, a, starts[keep], ends[keep], numbers[keep], labeled,
                           last_line=first + len(ends) - 1)
        first += len(ends)
        if limit is not None and first > limit:
            break


def _lines_of(positions: np.ndarray, starts: np.ndarray, ends: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """The positions that lie in one of the lines [starts, ends], and those lines' indices."""
    line = np.searchsorted(ends, positions)
    inside = line < len(ends)
    inside[inside] = positions[inside] >= starts[line[inside]]
    return positions[inside], line[inside]


def _words(words: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The 8 bytes before each of ``ends``, read big-endian (the last byte lowest), as uint64."""
    return words[ends - 8].astype(np.uint64)


def _parse_block(buf: bytes, a: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                 numbers: np.ndarray, labeled: bool, last_line: int) -> _Block:
    """Checks the lines [starts, ends) of ``a`` (numbered ``numbers``; (n,) each)."""
    n, fields, off = len(starts), (LABELED_FIELDS if labeled else UNLABELED_FIELDS), int(labeled)
    words = np.ndarray((len(a) - 7,), ">u8", buf, strides=(1,))  # (S - 7,) word p: a[p:p + 8]
    ends = ends - (a[ends - 1] == 13)  # a line's last '\r' goes (the reference's rstrip)
    tabs = np.flatnonzero(a == 9)  # (T,)
    first_tab = np.searchsorted(tabs, starts)  # (n,)
    plain = np.searchsorted(tabs, ends) - first_tab == fields - 1  # (n,) the right tab count
    if buf.translate(None, _ALLOWED):  # other characters: ' ', '+', a second '\r', ...
        odd = np.flatnonzero(~np.isin(a, np.frombuffer(_ALLOWED, np.uint8)))
        odd = odd[(a[odd] != 13) | (a[odd + 1] != 10)]  # a line's last '\r' is fine
        plain[_lines_of(odd, starts, ends)[1]] = False
    minus, line = _lines_of(np.flatnonzero(a == 45), starts, ends)  # '-' must start a count
    field = np.searchsorted(tabs, minus) - first_tab[line]
    plain[line[(field < off) | (field >= off + NUM_DENSE)
               | ((minus != starts[line]) & (a[minus - 1] != 9))
               | (a[minus + 1] - 48 > 9)]] = False  # and a digit must follow
    candidate = np.flatnonzero(plain)  # (m,)
    bounds = np.concatenate([starts[candidate, None] - 1,  # (m, F + 1) the tabs around fields
                             tabs[first_tab[candidate, None] + np.arange(fields - 1)],
                             ends[candidate, None]], axis=1)
    lengths = np.diff(bounds, axis=1) - 1  # (m, F)
    widths = lengths[:, off + NUM_DENSE:]  # (m, 26) the categories' lengths
    ok = (widths <= 16).all(axis=1)  # (m,)
    row, col = np.nonzero(widths == 16)  # values <= MAX_ID: 16 digits start with 0 ... 7
    ok[row[a[bounds[row, off + NUM_DENSE + col] + 1] - 48 > 7]] = False
    if labeled:
        ok &= (lengths[:, 0] == 1) & (a[bounds[:, 0] + 1] - 48 <= 1)  # "0" or "1"
    digits = lengths[:, off:off + NUM_DENSE] - (a[bounds[:, off:off + NUM_DENSE] + 1] == 45)
    ok &= (digits <= 16).all(axis=1)  # (m, 13) digits of each count (without its '-')
    count_ends = bounds[:, off + 1:off + 1 + NUM_DENSE]
    low = _words(words, count_ends) & _LOW_BYTES[np.minimum(digits, 8)]  # (m, 13)
    letters = (low + _u64(0x46)) & _u64(0x80)  # a byte above '9' (letters only are left)
    high = None
    if digits.max(initial=0) > 8:
        high = _words(words, count_ends - 8) & _LOW_BYTES[np.clip(digits - 8, 0, 8)]
        letters |= (high + _u64(0x46)) & _u64(0x80)
    ok &= ~letters.any(axis=1)
    fast = candidate[ok]  # (k,) into the n lines
    negative = (digits < lengths[:, off:off + NUM_DENSE])[ok]  # (k, 13)
    low, high = low[ok], None if high is None else high[ok]
    cat_ends, cat_lengths = bounds[ok, off + 1 + NUM_DENSE:], lengths[ok, off + NUM_DENSE:]
    labels = a[bounds[ok, 0] + 1] - 48 if labeled else None  # (k,)

    slow = np.setdiff1d(np.arange(n), fast, assume_unique=True)  # the reference's lines
    slow_rows = _empty_rows(len(slow))
    slow_good: list[int] = []
    bad: list[tuple[int, str]] = []
    for i, j in enumerate(slow.tolist()):
        text = buf[starts[j]:ends[j] + 1].decode("latin-1")
        try:
            slow_rows[2][i] = parse_line(text, labeled, slow_rows[0][i], slow_rows[1][i])
            slow_good.append(i)
        except ValueError as e:
            bad.append((int(numbers[j]), str(e)))
    good = np.concatenate([fast, slow[slow_good]])  # (g,) into the n lines
    order = np.argsort(good, kind="stable")
    source = np.concatenate([np.arange(len(fast)),  # >= 0: a fast line; < 0: ~ a slow one
                             ~np.asarray(slow_good, np.int64)])[order]  # (g,)

    def rows(i: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dense, sparse, label = _empty_rows(len(i))
        src = source[i]
        here = src >= 0
        if here.any():
            f = src[here]
            counts = _decimal(low[f]) + (0 if high is None else _decimal(high[f]) * 10**8)
            dense[here] = _log1p_counts(np.where(negative[f], -counts, counts))
            sparse[here] = _hex(words, cat_ends[f], cat_lengths[f])
            label[here] = labels[f] if labeled else np.nan
        if not here.all():
            other = ~src[~here]
            dense[~here], sparse[~here], label[~here] = (r[other] for r in slow_rows)
        return dense, sparse, label

    return _Block(last_line, numbers[good[order]], bad, rows, numbers[slow])


def _decimal(w: np.ndarray) -> np.ndarray:
    """Words of up to 8 decimal digits (the other bytes 0) -> their values, int64."""
    w = w & _u64(0x0F)  # '0' ... '9' -> 0 ... 9, a byte each
    w = ((w >> np.uint64(8)) & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(10) \
        + (w & np.uint64(0x00FF00FF00FF00FF))  # 2 digits per 16 bits
    w = ((w >> np.uint64(16)) & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(100) \
        + (w & np.uint64(0x0000FFFF0000FFFF))  # 4 digits per 32 bits
    w = (w >> np.uint64(32)) * np.uint64(10000) + (w & np.uint64(0xFFFFFFFF))
    return w.astype(np.int64)


def _nibbles(w: np.ndarray, digits: np.ndarray) -> np.ndarray:
    """Words ending in ``digits`` (<= 8) hex digits -> their values."""
    w = (w & _u64(0x0F)) + ((w >> np.uint64(6)) & _u64(0x01)) * np.uint64(9)  # a nibble a byte
    w = (w | (w >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)  # 2 nibbles a byte
    w = (w | (w >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
    w = (w | (w >> np.uint64(16))) & np.uint64(0x00000000FFFFFFFF)
    return w & _LOW_NIBBLES[digits]  # the bytes before the field were read too


def _hex(words: np.ndarray, ends: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The checked categories ending at ``ends`` (k, 26) -> (k, 26) int64 (0 ... MAX_ID, as the
    reference; empty: MISSING_ID)."""
    ids = _nibbles(_words(words, ends), np.minimum(lengths, 8))
    if lengths.max(initial=0) > 8:
        ids |= _nibbles(_words(words, ends - 8), np.clip(lengths - 8, 0, 8)) << np.uint64(32)
    ids = ids.view(np.int64)
    ids[lengths == 0] = MISSING_ID
    return ids


# ------------------------------------------------------------------------- batches
def read_batches(path: str | Path, batch_size: int, *,
                 hash_buckets: int | Sequence[int] | None = None, skip_bad: bool = False,
                 labeled: bool | None = None, limit: int | None = None,
                 part: Literal["all", "train", "test"] = "all", holdout_every: int = 0,
                 stats: ReadStats | None = None, start_after: int = 0,
                 share: tuple[int, int] | None = None,
                 parser: Literal["fast", "reference"] = "fast") -> Iterator[Batch]:
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
        share: ``(rank, world)``: of each batch, yield only examples rank, rank + world, ...
            (``batch[rank::world]``), converting only those lines (every line is still checked,
            so that all processes agree on the batches and on bad lines); ``stats`` counts the
            whole batches. None: whole batches.
        parser: "fast" (numpy over blocks of lines) or "reference" (one line at a time in
            Python, the specification; the same results, about 8 times slower).

    Yields:
        ``Batch(dense (B, 13) float32, sparse (B, 26) int64, label (B,) float32 or None)``.

    Raises:
        DataError: a malformed line (file and line number in the message), unless ``skip_bad``;
            a .gz file that is not gzip, or is truncated or corrupt (file and the last line
            read), whatever ``skip_bad`` says.
        ValueError: bad arguments.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if part not in ("all", "train", "test"):
        raise ValueError(f"part must be 'all', 'train' or 'test', got {part!r}")
    if part != "all" and holdout_every < 2:
        raise ValueError(f"part={part!r} needs holdout_every >= 2, got {holdout_every}")
    if parser not in ("fast", "reference"):
        raise ValueError(f"parser must be 'fast' or 'reference', got {parser!r}")
    rank, world = (0, 1) if share is None else share
    if not 0 <= rank < world:
        raise ValueError(f"share must be (rank, world) with 0 <= rank < world, got {share}")
    buckets = bucket_sizes(hash_buckets)
    stats = stats if stats is not None else ReadStats()
    if labeled is None:
        labeled = detect_labeled(path)
    stats.labeled = labeled
    if parser == "reference":
        yield from _reference_batches(path, batch_size, buckets, skip_bad, labeled, limit, part,
                                      holdout_every, stats, start_after, rank, world)
    else:
        blocks = _fast_blocks(path, labeled, limit, start_after, part, holdout_every)
        yield from _batches(blocks, path, batch_size, labeled, buckets, skip_bad, stats, rank,
                            world)


def _batches(blocks: Iterator[_Block], path: str | Path, batch_size: int, labeled: bool,
             buckets: np.ndarray | None, skip_bad: bool, stats: ReadStats, rank: int,
             world: int) -> Iterator[Batch]:
    """Cuts the stream of good lines into batches; counts what the reference loop counts, as
    it counts it (``stats`` at each yield are the reference's)."""
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # this batch's rows so far
    filled = 0  # examples of the current batch (all processes)

    def emit() -> Batch:
        dense, sparse, label = (np.concatenate(x) for x in zip(*parts, strict=True))
        parts.clear()
        if buckets is not None:
            sparse[sparse == MISSING_ID] = MISSING_HASHED_VALUE
            sparse %= buckets  # (B, 26); numpy's % is >= 0 for positive buckets
        return Batch(dense, sparse, label if labeled else None)

    def count_bad(bad: deque[tuple[int, str]], before: float) -> None:
        """Counts the bad lines numbered below ``before`` (and drops them from ``bad``)."""
        while bad and bad[0][0] < before:
            number, message = bad.popleft()
            stats.skipped += 1
            if len(stats.examples_of_bad) < _MAX_BAD_EXAMPLES:
                stats.examples_of_bad.append(f"{path}:{number}: {message}")

    for block in blocks:
        good, bad = block.good, deque(block.bad)
        if bad and not skip_bad:
            good = good[good < bad[0][0]]
        place = (filled + np.arange(len(good))) % batch_size  # (g,) places in their batches
        mine = np.flatnonzero(place % world == rank)  # (h,)
        rows = block.rows(mine) if len(mine) else _empty_rows()
        taken = 0
        for last in np.flatnonzero(place == batch_size - 1).tolist():  # batches completed
            upto = int(np.searchsorted(mine, last, side="right"))
            parts.append(tuple(r[taken:upto] for r in rows))
            taken = upto
            count_bad(bad, good[last])
            stats.lines = int(good[last])
            stats.examples += batch_size
            yield emit()
        parts.append(tuple(r[taken:] for r in rows))
        filled = (filled + len(good)) % batch_size
        if bad and not skip_bad:
            number, message = bad[0]
            stats.lines = number
            raise DataError(f"{path}:{number}: {message} (skip_bad / --skip-bad skips such "
                            f"lines)")
        count_bad(bad, math.inf)
        stats.lines = block.last_line or stats.lines
    if filled:
        stats.examples += filled
        yield emit()


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
    return np.asarray([s.size for s in distinct_ids(path, **kwargs)], dtype=np.int64)


def distinct_ids(path: str | Path, **kwargs) -> list[np.ndarray]:
    """Each feature's distinct ids over the (part of the) file read, ascending: 26 int64 arrays.
    One whole pass (``count_distinct`` counts them)."""
    seen: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(NUM_SPARSE)]
    pending: list[list[np.ndarray]] = [[] for _ in range(NUM_SPARSE)]
    for i, batch in enumerate(read_batches(path, 65536, **kwargs)):
        for j in range(NUM_SPARSE):
            pending[j].append(np.unique(batch.sparse[:, j]))
        if i % 16 == 15:
            for j in range(NUM_SPARSE):
                seen[j] = np.unique(np.concatenate([seen[j], *pending[j]]))
                pending[j] = []
    return [np.unique(np.concatenate([seen[j], *pending[j]])) for j in range(NUM_SPARSE)]
