"""The publish directory: numbered, chained, checksummed snapshots and deltas of an engine's rows.

``ec.publish`` writes here and ``ec.load_published`` / ``ec.load`` read here (online.py,
serving/follow.py); this module is the format and its reader: files, names, checks. The writer's
steps (part files, commit, retention, the writer lock) are publish_writer.py's. Layout:

    <directory>/
      .writer.lock                   held (``flock``) by the one trainer publishing here
      00000000-snapshot/             every row of every table
        manifest.json                the entry: seq, kind, its predecessor, step, spec, checksums
        r00000-0000.pt ...           rows written by process 0 (``torch.save``, tensors only)
      00000001-delta/                the rows changed since entry 0
      .tmp-00000002-<token>/         an entry being written (never read)

An **entry** is a directory named by its sequence number and kind, made complete in a temporary
directory and renamed into place (atomic: a reader sees all of it or nothing; a writer killed
mid-publish leaves only a ``.tmp-`` directory, removed by the next publish once its writer is
gone). Its ``manifest.json`` is plain JSON: ``{"format", "format_version", "seq", "kind"
("snapshot" | "delta"), "id" (random, unique), "previous" ({"seq", "id"} of the entry it follows,
or None for the first snapshot of a chain), "step", "slots", "spec", "serving_spec", "engine"
(the engine's manifest), "world_size", "files" ({file: {tensor key: CRC-32}}), "sizes" ({file:
bytes}), "chain" (the id of the chain's first entry), "rows" ({table: rows carried}), "bytes",
"time"}``. ("sizes" and "chain" are absent from entries written before them; such entries are
read as before: see Chains below.)

Each process writes its rows into **part files** of at most ``PART_BYTES`` (publish_writer.py)
(``torch.save`` of a flat ``{key: tensor}``, read back with ``weights_only=True``): per logical
table ``T`` it holds,

    T/rows                (n,) int64   rows of the whole logical table
    T/columns             (2,) int64   [c0, c1): the columns held, when not all (column sharding)
    T/parameters          (n, c1 - c0)
    T/<slot>              (n, c)       with ``slots=True`` (accumulators, momenta, ...)
    T/vocabulary/ids      (n, 1) int64 a dynamic table: the raw id each row holds ...
    T/vocabulary/last_use (n, 1) int64 ... 0 when the row is free (its id evicted)
    T/vocabulary/frequency, T/vocabulary/step, T/vocabulary/seed    the map's counters
    T/vocabulary/evicted  (e,) int64   a delta: the ids evicted since its predecessor
    T/vocabulary/pending  (p, 3) int64 with ``slots=True`` and ``admit_after > 1``: the ids this
                          process counts for admission, their counts and last steps seen
                          (every entry, whole: such a table's first part always goes, even
                          with no rows)

A snapshot carries every row; a delta the rows written since its predecessor (a dynamic table:
also the rows freed since, with ``last_use`` 0). A replicated table is written by process 0 only.
Part files hold row numbers, not shards, so any world size reads any entry.

Why ``torch.save`` files and not ``torch.distributed.checkpoint`` (which ``ec.save`` uses): a
delta is a different, small set of rows on each process each time; DCP plans tensors of global
shapes and reshards them, which a delta does not need (rows carry their numbers), and stores its
index as a pickle. A part file is a zip of raw tensor bytes that torch reads without unpickling
code (``weights_only``), and whose bytes we checksum ourselves.

Integrity: every tensor's bytes have a CRC-32 (zlib's; 4 GB/s here) in the manifest, checked
before any value is used; a mismatch, a missing or unreadable file, a missing entry in the
chain or a predecessor that is not the one named is a ``PublishError`` (a ValueError) naming it.

Reading: a reader shares the directory with others who may change it, so every file is opened
without following a symbolic link and without blocking (``O_NOFOLLOW | O_NONBLOCK``), must be a
regular file (not a FIFO, a device, a directory) of the size its manifest states (a manifest: at
most ``MANIFEST_BYTES``), and is read into memory, never mapped: a file truncated while it is
read is a ``PublishError``, never a ``SIGBUS``; anything else is a ``PublishError`` naming the
file. A manifest holds finite numbers and 64-bit integers only: ``NaN``, ``Infinity``, ``1e999``
or an integer of more digits is a ``PublishError`` (read, never converted). An entry removed
while it is read (the writer's retention) is an ``EntryGone``: readers read the newest chain
again (``newest``). Only the entries a reader applies must be readable (``chain``); an older
entry whose manifest cannot be read is passed over (``identity``, ``continuation``).

Chains: a directory holds one model's chain of entries. Its first entry's id is the chain's
identity, which every entry carries (``chain``); a trainer that publishes into a directory
holding entries continues its chain (its first snapshot names the newest entry as its
predecessor). A reader refuses an entry of another chain (a snapshot copied in from another
directory), a snapshot naming no predecessor that is not the chain's first entry, and a
predecessor that is present under another id. The directory's identity is the ``chain`` of its
oldest entry that carries one; entries written before chains were kept carry none and are
accepted as before while no older entry carries one.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from .files import crc, crc32, kind_of

FORMAT = "embcore.publish"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LOCK = ".writer.lock"
MANIFEST_BYTES = 64 << 20  # a manifest larger than this is refused unread
READ_TRIES = 8  # readers read the newest chain again this often when retention removes entries
_ENTRY = re.compile(r"^(\d{8})-(snapshot|delta)$")


class PublishError(ValueError):
    """A publish directory that cannot be read as it must be: a corrupt or missing file, a gap
    in its chain, an entry of another format or another chain."""


class EntryGone(PublishError):
    """An entry removed while it was read (the writer's retention): read the newest chain
    again."""


_T = TypeVar("_T")


@dataclass(frozen=True)
class Entry:
    """One complete entry of a publish directory."""

    seq: int
    kind: str  # "snapshot" | "delta"
    path: Path

    def manifest(self) -> dict[str, Any]:
        """The entry's manifest, checked for format. Raises PublishError."""
        path = self.path / MANIFEST
        fd = open_in_entry(path)
        try:
            size = os.fstat(fd).st_size
            if size > MANIFEST_BYTES:
                raise PublishError(f"{path} is {size} bytes, more than a manifest's "
                                   f"{MANIFEST_BYTES}; the entry is corrupt")
            raw = read_exactly(fd, size, path)
        finally:
            os.close(fd)
        try:
            m = loads_finite(raw)
        except (ValueError, RecursionError) as e:  # (JSONDecodeError, UnicodeDecodeError, ours)
            raise PublishError(f"{path} is unreadable or not JSON ({e}); the entry is "
                               f"corrupt") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise PublishError(f"{path} is not an embcore publish manifest")
        if not isinstance(m.get("format_version"), int) or m["format_version"] > FORMAT_VERSION:
            raise PublishError(f"{path} has format version {m.get('format_version')!r}; this "
                               f"embcore reads up to {FORMAT_VERSION}")
        seal = m.pop("seal", None) if isinstance(m, dict) else None
        if seal != _seal(m):
            raise PublishError(f"{path} does not match its seal (a CRC-32 of its content): the "
                               f"manifest is corrupt")
        if m.get("seq") != self.seq or m.get("kind") != self.kind:
            raise PublishError(f"{path} says seq {m.get('seq')!r} kind {m.get('kind')!r} but "
                               f"sits in {self.path.name}; the entry is corrupt")
        files = m.get("files")
        if not isinstance(files, dict) or not all(
                isinstance(f, str) and f == os.path.basename(f) and f not in ("", ".", "..")
                and isinstance(k, dict) for f, k in files.items()):
            raise PublishError(f"{path}: a malformed file list")
        sizes = m.get("sizes")
        if sizes is not None and not (isinstance(sizes, dict) and set(sizes) == set(files) and all(
                type(n) is int and n >= 0 for n in sizes.values())):
            raise PublishError(f"{path}: a malformed list of file sizes")
        if m.get("chain") is not None and not isinstance(m["chain"], str):
            raise PublishError(f"{path}: a malformed chain identity {m['chain']!r}")
        return m


def _no_constant(name: str) -> Any:
    """``json.loads``' hook for ``NaN`` / ``Infinity``, which no manifest holds."""
    raise ValueError(f"it holds {name}, which a manifest never does")


def _finite_float(text: str) -> float:
    """``json.loads``' hook for a number with a point or exponent: a finite float (``1e999``
    would read as infinity)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"it holds the number {text[:40]}, beyond a float's range")
    return value


def _int64(text: str) -> int:
    """``json.loads``' hook for an integer: a manifest's are 64-bit (a step, sizes, rows,
    checksums), so more digits are refused before they are converted."""
    value = int(text) if len(text) <= 20 else None
    if value is None or not -2**63 <= value < 2**63:
        raise ValueError(f"it holds an integer of {len(text.lstrip('-'))} digits, beyond 64 "
                         f"bits")
    return value


def loads_finite(raw: bytes, int64: bool = True) -> Any:
    """``raw`` (UTF-8 JSON) decoded, as a manifest must be: finite numbers only (``NaN``,
    ``Infinity`` and ``1e999``, which would read as infinity, are refused) and, with ``int64``,
    integers of 64 bits (more digits refused before they are converted). Checkpoint manifests
    are read with it too (``int64=False``: their ``extra`` may hold larger integers).

    Raises:
        ValueError: not UTF-8, not JSON or a number it refuses (saying which).
        RecursionError: nested too deep.
    """
    return json.loads(raw.decode("utf-8"), parse_constant=_no_constant,
                      parse_float=_finite_float, parse_int=_int64 if int64 else int)


def entries(directory: Path) -> list[Entry]:
    """The complete entries of ``directory``, by sequence number (temporaries and other names
    are ignored). Raises PublishError: two entries with one number."""
    out: dict[int, Entry] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        m = _ENTRY.match(name)
        if m is None:
            continue
        seq = int(m.group(1))
        if seq in out:
            raise PublishError(f"{directory} holds two entries numbered {seq} "
                               f"({out[seq].path.name}, {name})")
        out[seq] = Entry(seq, m.group(2), directory / name)
    return [out[k] for k in sorted(out)]


def is_publish_dir(path: Path) -> bool:
    """Whether ``path`` is a directory holding at least one publish entry."""
    return path.is_dir() and bool(entries(path))


# ------------------------------------------------------------------------------------ chains
def chain(directory: Path, after: tuple[int, str] | None = None) -> list[Entry]:
    """The entries a reader applies, in order, to reach the newest state.

    ``after``: the ``(seq, id)`` the reader holds (None: nothing). When the entries after it
    link to it one by one, those; otherwise (nothing held, or the reader fell behind entries
    that were removed) the newest snapshot and the entries after it. Empty: nothing newer.
    Every entry returned belongs to the directory's chain (module docstring, Chains).

    Raises:
        PublishError: no snapshot to start from; an entry missing between two others, or one
            whose predecessor is not the entry before it; an entry of another chain.
        EntryGone: an entry was removed while it was read (read again).
    """
    found = entries(directory)
    run = _run(directory, found, after)
    if run:
        _check_chain(found, run)
    return run


def _run(directory: Path, found: list[Entry], after: tuple[int, str] | None) -> list[Entry]:
    if after is not None:
        newer = [e for e in found if e.seq > after[0]]
        if not newer:
            return []
        if newer[0].seq == after[0] + 1:
            previous = newer[0].manifest().get("previous")
            if isinstance(previous, dict) and (previous.get("seq"), previous.get("id")) == \
                    tuple(after):
                return _linked(newer)
    snapshots = [e for e in found if e.kind == "snapshot"]
    if not snapshots:
        if found:
            raise PublishError(f"{directory} holds deltas {found[0].seq}..{found[-1].seq} "
                               f"but no snapshot to apply them to")
        raise FileNotFoundError(f"{directory} holds no published entry")
    if after is not None and snapshots[-1].seq <= after[0]:
        raise PublishError(f"{directory}: entry {after[0] + 1} is missing or does not follow "
                           f"the entry {after[0]} this reader holds, and no newer snapshot "
                           f"starts over")
    return _linked([e for e in found if e.seq >= snapshots[-1].seq])


def _linked(run: list[Entry]) -> list[Entry]:
    """``run`` checked: consecutive numbers, each entry's predecessor the one before it."""
    ids: dict[int, str | None] = {}
    for i, e in enumerate(run):
        m = e.manifest()
        ids[e.seq] = m.get("id")
        if i == 0:
            continue
        if e.seq != run[i - 1].seq + 1:
            raise PublishError(f"entry {run[i - 1].seq + 1} is missing from "
                               f"{e.path.parent} (found {run[i - 1].seq}, then {e.seq})")
        previous = m.get("previous")
        if (e.kind == "delta" or previous is not None) and (
                not isinstance(previous, dict) or (previous.get("seq"), previous.get("id"))
                != (run[i - 1].seq, ids[e.seq - 1])):
            raise PublishError(f"{e.path} does not follow {run[i - 1].path.name} (it names "
                               f"{previous!r} as its predecessor): two writers, or a damaged "
                               f"directory")
    return run


def identity(found: Sequence[Entry]) -> tuple[str | None, int | None]:
    """The chain identity of a directory whose entries are ``found``: the ``chain`` of its
    oldest entry that carries one (entries that cannot be read are passed over), and that
    entry's number; ``(None, None)`` when none carries one (written before chains were kept)."""
    for e in found:
        try:
            own = e.manifest().get("chain")
        except PublishError:
            continue
        if own is not None:
            return own, e.seq
    return None, None


def _check_chain(found: list[Entry], run: list[Entry]) -> None:
    """Refuses an entry of ``run`` that is not of the directory's chain (module docstring,
    Chains), naming it and why."""
    ident, since = identity(found)
    at = {e.seq: e for e in found}
    for e in run:
        m = e.manifest()
        own = m.get("chain")
        if own is None:
            if since is not None and e.seq > since:
                raise PublishError(
                    f"{e.path} carries no chain identity but follows entry {since} of the "
                    f"directory's chain {ident}: it was written elsewhere (or by an older "
                    f"embcore) and copied in; a directory holds one model's chain, so it is "
                    f"refused (remove it)")
            continue
        if own != ident:
            raise PublishError(
                f"{e.path} belongs to chain {own}, not to this directory's chain {ident} (that "
                f"of entry {since}): it was copied in from another publish directory; a "
                f"directory holds one model's chain, so it is refused (remove it)")
        previous = m.get("previous")
        if previous is None:
            if m.get("id") != own:
                raise PublishError(
                    f"{e.path} names no predecessor, yet it is not the first entry of its chain "
                    f"{own}; an entry after the first must name one, so it is refused")
            continue
        if not isinstance(previous, dict) or type(previous.get("seq")) is not int or \
                previous["seq"] >= e.seq:
            raise PublishError(f"{e.path} names {previous!r} as its predecessor, not an "
                               f"earlier entry; the entry is corrupt")
        named = at.get(previous["seq"])
        if named is not None and e.kind == "snapshot":
            try:
                got = named.manifest().get("id")
            except PublishError:  # (unreadable, or gone: nothing to compare)
                continue
            if got != previous.get("id"):
                raise PublishError(
                    f"{e.path} names entry {previous['seq']} with id {previous.get('id')!r} as "
                    f"its predecessor, but {named.path.name} has id {got!r}: it continues "
                    f"another copy of this chain, so it is refused")


def newest(directory: Path, read: Callable[[list[Entry], list[dict[str, Any]]], _T]) -> _T:
    """``read(run, manifests)`` of the newest chain (``chain(directory)``), read again when the
    writer's retention removes one of its entries meanwhile (``EntryGone``), ``READ_TRIES``
    times at most.

    Raises:
        PublishError: what ``chain`` and ``read`` raise; entries removed while read every time.
    """
    gone: EntryGone | None = None
    for _ in range(READ_TRIES):
        try:
            run = chain(directory)
            return read(run, [e.manifest() for e in run])
        except EntryGone as e:
            gone = e
    raise removed_too_often(directory, gone)


def removed_too_often(directory: Path, gone: BaseException | None) -> PublishError:
    return PublishError(
        f"{directory}: entries were removed while they were read, {READ_TRIES} times in a row "
        f"({gone}): the trainer's retention removes them faster than this reader reads them; "
        f"publish with a larger keep_snapshots")


def continuation(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    """What a trainer's first entry in ``directory`` names: its predecessor (``{"seq", "id"}``
    of the newest entry that can be read; None when there is none) and the directory's chain
    identity (None: none yet, the entry starts one)."""
    found = entries(directory)
    previous = None
    for e in reversed(found):
        try:
            previous = {"seq": e.seq, "id": e.manifest()["id"]}
            break
        except (PublishError, KeyError):
            continue
    return previous, identity(found)[0]


# ------------------------------------------------------------------------------------ files
_READ_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


def open_regular(path: Path, error: type[ValueError] = PublishError,
                 whose: str = "a publish directory's") -> int:
    """A read-only descriptor of ``path``, which must be a regular file: opened without
    following a symbolic link and without blocking (a FIFO would), then checked. (Checkpoint
    reads use it too: ``error`` is the type raised, ``whose`` the files' owner in its message.)

    Raises:
        FileNotFoundError: no such file.
        PublishError: (``error``) a symbolic link, a FIFO, a device, a directory, ..., or a file
            that cannot be opened, named.
    """
    if not hasattr(os, "O_NOFOLLOW") and os.path.islink(path):
        raise error(f"{path} is a symbolic link; {whose} files are regular files, read "
                    f"without following links")
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as e:
        if os.path.islink(path):
            raise error(f"{path} is a symbolic link; {whose} files are regular files, read "
                        f"without following links") from None
        raise error(f"{path} cannot be opened: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path} is {kind_of(mode)}, not a regular file; {whose} files are "
                        f"regular files")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_in_entry(path: Path) -> int:
    """``open_regular`` of a file of an entry (``path.parent``).

    Raises:
        EntryGone: the entry itself is gone (the writer's retention removed it meanwhile).
        PublishError: the file is missing from an entry still there (the entry is
            incomplete), or is not a regular file.
    """
    try:
        return open_regular(path)
    except FileNotFoundError:
        if not os.path.lexists(path.parent):
            raise EntryGone(f"{path.parent} was removed while it was read") from None
        raise PublishError(f"{path} is missing: the entry is incomplete") from None


def read_exactly(fd: int, size: int, path: Path, error: type[ValueError] = PublishError
                 ) -> bytes:
    """``size`` bytes from the start of ``fd``. Raises PublishError (``error``): the file ended
    first (it was truncated)."""
    out = bytearray(size)
    view = memoryview(out)
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise error(f"{path} ended after {got} of its {size} bytes: it was truncated "
                        f"while it was read")
        got += n
    return bytes(out)


def read_part(path: Path, sums: Mapping[str, int], size: int | None = None
              ) -> dict[str, torch.Tensor]:
    """A part file's tensors, every checksum verified. The file is read (never mapped: module
    docstring, Reading), as a regular file of ``size`` bytes (None: an entry written before
    sizes were kept).

    Raises:
        PublishError: the file is missing, not a regular file, not of its size, unreadable,
            holds other keys than the manifest lists, or a tensor whose bytes do not match its
            checksum (naming file and key).
        EntryGone: its entry was removed while it was read.
    """
    fd = open_in_entry(path)
    with os.fdopen(fd, "rb") as f:
        have = os.fstat(fd).st_size
        if size is not None and have != size:
            raise PublishError(f"{path} is {have} bytes but its manifest says {size}: the file "
                               f"is truncated or was replaced")
        try:
            got = torch.load(f, weights_only=True, map_location="cpu")
        except Exception as e:  # (a damaged zip: RuntimeError, pickle errors, ...)
            said = (str(e).strip().splitlines() or [""])[0].split(". ")[0]  # (its first
            if len(said) > 160:  # sentence: torch's next ones speak of its own internals)
                said = said[:160].rsplit(" ", 1)[0] + " ..."
            raise PublishError(f"{path} is corrupt or truncated: torch.load cannot read it "
                               f"({type(e).__name__}: {said}). Its entry cannot be applied; a "
                               f"new snapshot (ec.publish(..., snapshot=True)) lets followers "
                               f"start over past it") from None
    if not isinstance(got, dict) or set(got) != set(sums) or not all(
            isinstance(v, torch.Tensor) for v in got.values()):
        raise PublishError(f"{path} does not hold the tensors its manifest lists")
    for k, v in got.items():
        if crc(v) != sums[k]:
            raise PublishError(f"{path}: tensor {k!r} does not match its checksum; the file "
                               f"is corrupt")
    return got


def read_entry(entry: Entry, manifest: Mapping[str, Any] | None = None
               ) -> Iterator[dict[str, torch.Tensor]]:
    """Every part file of ``entry`` (verified), one at a time."""
    m = manifest if manifest is not None else entry.manifest()
    sizes = m.get("sizes") or {}
    for name, sums in m["files"].items():
        yield read_part(entry.path / name, sums, sizes.get(name))


# ------------------------------------------------------------------------------ names, seal
def entry_name(seq: int, kind: str) -> str:
    return f"{seq:08d}-{kind}"


def manifest_text(manifest: Mapping[str, Any]) -> str:
    """The text of an entry's ``manifest.json``: ``manifest`` and its seal."""
    return json.dumps({**manifest, "seal": _seal(manifest)}, indent=1, allow_nan=False)


def _seal(manifest: Any) -> int:
    """CRC-32 of a manifest's content (its canonical JSON, keys sorted): every field is checked,
    the step and the spec as much as the checksums."""
    return crc32(json.dumps(manifest, sort_keys=True, allow_nan=False).encode())


# ------------------------------------------------------------------------------------ replay
def tables_in(part: Mapping[str, torch.Tensor]) -> list[str]:
    """The logical tables a part file holds rows of."""
    return [k[:-len("/rows")] for k in part if k.endswith("/rows")]


# ``replay``'s shape of a key whose value each entry carries whole, in parts (one per process,
# concatenated and sorted by their first column): a dynamic table's admission counts. An entry
# without it (published before it was kept, or without slots) leaves the previous value.
VARIABLE: tuple[int, ...] = (-1,)


def apply_part(part: Mapping[str, torch.Tensor], state: dict[str, torch.Tensor],
               shapes: Mapping[str, tuple[int, ...]],
               whole: dict[str, list[torch.Tensor]] | None = None) -> None:
    """Writes a part file's rows into whole tensors ``state`` (``{key: (N, C)}``, made on
    first use from ``shapes`` with the part's dtype; 0-d values replaced), for the keys in
    ``shapes``; values of the keys whose shape is ``VARIABLE`` (a part of a whole value that
    each entry carries anew) are appended to ``whole[key]`` instead."""
    for name in tables_in(part):
        rows = part[f"{name}/rows"]
        columns = part.get(f"{name}/columns")
        for k, v in part.items():
            if not k.startswith(name + "/") or k not in shapes:
                continue
            if shapes[k] == VARIABLE:
                if whole is not None:
                    whole.setdefault(k, []).append(v)
                continue
            if v.dim() == 0:
                state[k] = v.clone()
                continue
            dest = state.get(k)
            if dest is None:
                dest = state[k] = torch.zeros(shapes[k], dtype=v.dtype)
            if columns is not None and v.shape[1] != dest.shape[1]:
                c0, c1 = (int(c) for c in columns)
                width = c1 - c0
            else:
                c0, c1, width = 0, dest.shape[1], dest.shape[1]
            if tuple(v.shape[1:]) != (width,):
                raise PublishError(f"{k} has shape {list(v.shape)} in the entry but {width} "
                                   f"columns are read into (another optimizer's slot of that "
                                   f"name?)")
            dest[rows, c0:c1] = v.to(dest.dtype)


def replay(run: list[Entry], manifests: Sequence[Mapping[str, Any]],
           shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The whole tensors of ``shapes``' keys after applying ``run`` (a snapshot and the entries
    after it, from ``chain``) in order. Raises PublishError: a key no entry holds."""
    state: dict[str, torch.Tensor] = {}
    for entry, m in zip(run, manifests):
        whole: dict[str, list[torch.Tensor]] = {}
        for part in read_entry(entry, m):
            apply_part(part, state, shapes, whole)
        for k, parts in whole.items():  # every process's part: the entry's whole value
            v = torch.cat(parts)
            state[k] = v[torch.argsort(v[:, 0])] if v.dim() == 2 and v.shape[0] else v
    lacking = sorted(k for k in set(shapes) - set(state) if shapes[k] != VARIABLE)
    if lacking:
        raise PublishError(f"{run[0].path.parent} holds no values for {lacking}")
    return state
