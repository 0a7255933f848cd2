"""The publish directory: numbered, chained, checksummed snapshots and deltas of an engine's rows.

``ec.publish`` writes here and ``ec.load_published`` / ``ec.load`` read here (online.py,
serving/follow.py); this module is the format alone: files, names, checks. Layout:

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
(the engine's manifest), "world_size", "files" ({file: {tensor key: CRC-32}}), "rows"
({table: rows carried}), "bytes", "time"}``.

Each process writes its rows into **part files** of at most ``PART_BYTES`` (``torch.save`` of a
flat ``{key: tensor}``, read back with ``weights_only=True``): per logical table ``T`` it holds,

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
code (``weights_only``) and can map (``mmap``), and whose bytes we checksum ourselves.

Integrity: every tensor's bytes have a CRC-32 (zlib's; 4 GB/s here) in the manifest, checked
before any value is used; a mismatch, a missing or unreadable file, a missing entry in the
chain or a predecessor that is not the one named is a ``PublishError`` (a ValueError) naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .files import fsync_dir, pid_alive

FORMAT = "embcore.publish"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LOCK = ".writer.lock"
PART_BYTES = 256 << 20  # a part file holds at most about this many bytes of tensors
_ENTRY = re.compile(r"^(\d{8})-(snapshot|delta)$")
_TMP = re.compile(r"^\.tmp-(\d{8})-(\d+)-([0-9a-f]+)$")


class PublishError(ValueError):
    """A publish directory that cannot be read as it must be: a corrupt or missing file, a gap
    in its chain, an entry of another format."""


@dataclass(frozen=True)
class Entry:
    """One complete entry of a publish directory."""

    seq: int
    kind: str  # "snapshot" | "delta"
    path: Path

    def manifest(self) -> dict[str, Any]:
        """The entry's manifest, checked for format. Raises PublishError."""
        path = self.path / MANIFEST
        try:
            m = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PublishError(f"{path} is missing: the entry is incomplete") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
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
        return m


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
    link to it one by one, those; otherwise (nothing held, the reader fell behind entries that
    were removed, or the writer started a new chain) the newest snapshot and the entries after
    it. Empty: nothing newer.

    Raises:
        PublishError: no snapshot to start from; an entry missing between two others, or one
            whose predecessor is not the entry before it.
    """
    found = entries(directory)
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
        if e.kind == "delta" and (not isinstance(previous, dict) or (
                previous.get("seq"), previous.get("id")) != (run[i - 1].seq, ids[e.seq - 1])):
            raise PublishError(f"{e.path} does not follow {run[i - 1].path.name} (it names "
                               f"{previous!r} as its predecessor): two writers, or a damaged "
                               f"directory")
    return run


# ------------------------------------------------------------------------------------ files
def crc(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes (row-major)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    return zlib.crc32(flat.view(torch.uint8).numpy().data)


def write_part(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Writes a part file (fsynced) and returns its tensors' checksums."""
    sums = {k: crc(v) for k, v in tensors.items()}
    with open(path, "wb") as f:
        torch.save(dict(tensors), f)
        f.flush()
        os.fsync(f.fileno())
    return sums


def read_part(path: Path, sums: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """A part file's tensors (mapped, not copied), every checksum verified.

    Raises:
        PublishError: the file is missing, unreadable, holds other keys than the manifest
            lists, or a tensor whose bytes do not match its checksum (naming file and key).
    """
    try:
        got = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except FileNotFoundError:
        raise PublishError(f"{path} is missing") from None
    except Exception as e:  # (a damaged zip: RuntimeError, pickle errors, ...)
        said = (str(e).strip().splitlines() or [""])[0].split(". ")[0]  # (its first sentence:
        if len(said) > 160:  # torch's next ones speak of its own internals)
            said = said[:160].rsplit(" ", 1)[0] + " ..."
        raise PublishError(f"{path} is corrupt or truncated: torch.load cannot read it "
                           f"({type(e).__name__}: {said}). Its entry cannot be applied; a new "
                           f"snapshot (ec.publish(..., snapshot=True)) lets followers start "
                           f"over past it") from None
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
    for name, sums in m["files"].items():
        yield read_part(entry.path / name, sums)


def parts(tables: Iterable[Iterator[dict[str, torch.Tensor]]]
          ) -> Iterator[dict[str, torch.Tensor]]:
    """Groups tensors into part files of about ``PART_BYTES``: ``tables`` yields, per table, its
    chunks (``{key: tensor}`` of some rows, cut to ``PART_BYTES`` by the caller); a part holds
    whole chunks, and a table's next chunk (the same keys) starts a new part."""
    part: dict[str, torch.Tensor] = {}
    size = 0
    for chunks in tables:
        for chunk in chunks:
            n = sum(v.nbytes for v in chunk.values())
            if part and (size + n > PART_BYTES or any(k in part for k in chunk)):
                yield part
                part, size = {}, 0
            part.update(chunk)
            size += n
    if part:
        yield part


def part_name(rank: int, i: int) -> str:
    return f"r{rank:05d}-{i:04d}.pt"


# ------------------------------------------------------------------------------------ commit
def entry_name(seq: int, kind: str) -> str:
    return f"{seq:08d}-{kind}"


def temporary(directory: Path, seq: int, token: str) -> Path:
    """The temporary directory an entry is written in (``token``: the same on every process,
    starting with the writer's pid)."""
    return directory / f".tmp-{seq:08d}-{token}"


def new_id() -> str:
    return secrets.token_hex(8)


def commit(tmp: Path, directory: Path, manifest: Mapping[str, Any]) -> Entry:
    """Makes the written temporary directory ``tmp`` an entry: writes its manifest, syncs, and
    renames it into place (atomic). Raises FileExistsError: the entry exists (another writer)."""
    text = json.dumps({**manifest, "seal": _seal(manifest)}, indent=1, allow_nan=False)
    with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    final = directory / entry_name(manifest["seq"], manifest["kind"])
    if any(e.seq == manifest["seq"] for e in entries(directory)):
        raise FileExistsError(f"{directory} already holds an entry {manifest['seq']}: another "
                              f"writer publishes to this directory")
    os.rename(tmp, final)
    fsync_dir(directory)
    return Entry(manifest["seq"], manifest["kind"], final)


def _seal(manifest: Any) -> int:
    """CRC-32 of a manifest's content (its canonical JSON, keys sorted): every field is checked,
    the step and the spec as much as the checksums."""
    return zlib.crc32(json.dumps(manifest, sort_keys=True, allow_nan=False).encode())


def remove_stale(directory: Path) -> None:
    """Removes temporaries of writers that died on this machine (what a killed publish
    leaves)."""
    for name in os.listdir(directory) if directory.is_dir() else ():
        m = _TMP.match(name)
        if m is not None and not pid_alive(int(m.group(2))):
            shutil.rmtree(directory / name, ignore_errors=True)


def retain(directory: Path, snapshots: int) -> list[Path]:
    """Removes entries older than the ``snapshots``-th newest snapshot (a reader behind them
    starts over from a newer snapshot); returns what it removed."""
    found = entries(directory)
    kept = [e for e in found if e.kind == "snapshot"][-snapshots:]
    if not kept:
        return []
    removed = []
    for e in found:
        if e.seq >= kept[0].seq:
            break
        # rename first, so that a reader never lists a half-removed entry as complete
        trash = directory / f".tmp-{e.seq:08d}-{os.getpid()}-{secrets.token_hex(4)}"
        with contextlib.suppress(FileNotFoundError):
            os.rename(e.path, trash)
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(e.path)
    return removed


class WriterLock:
    """The directory's writer lock: one trainer at a time publishes to a directory.

    ``flock`` on ``<directory>/.writer.lock``, held until ``release`` (or the process ends,
    even by ``kill -9``: the kernel drops it). Where ``flock`` is unavailable the sequence
    check of ``commit`` still refuses a second writer's entry."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        self._file = open(self.path, "a+", encoding="utf-8")
        try:
            import fcntl
        except ImportError:  # (not POSIX)
            return
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            who = self._file.read().strip() or "another process"
            self._file.close()
            raise RuntimeError(f"another trainer publishes to {directory} ({who}); one "
                               f"directory takes one trainer's entries") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self._file.flush()

    def release(self) -> None:
        self._file.close()


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
                dest[rows, c0:c1] = v.to(dest.dtype)
            else:
                dest[rows] = v.to(dest.dtype)


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
