"""The checkpoint directory's format: what ``ec.save`` writes and ``ec.load`` reads (checkpoint.py).

Format. A checkpoint is a directory written by ``torch.distributed.checkpoint`` (DCP):

    <path>/
      .metadata        DCP's index: every key's shape, dtype and where its bytes lie (a pickle)
      __0_0.distcp     the tensors' bytes (one file per writing process)
      manifest.json    plain JSON: the object's ``manifest()`` (configs, plan, step), the user's
                       ``extra`` metadata, the format version and ``checksums`` (Integrity below)

holding the object's ``state_dict()`` under TF's names: ``<table>/parameters``,
``<table>/<slot>`` (accumulators, momenta, velocities, linears) and ``step``; a dynamic table
(raw ids) adds its map, ``<table>/vocabulary/{ids,last_use,frequency}`` laid out by row like its
parameters, ``<table>/vocabulary/{step,seed}`` and ``<table>/vocabulary/pending`` (the ids
counted for admission, their counts and last steps seen: ``(P, 3)``, P varying; vocabulary.py).
Entries are whole logical tables, so a checkpoint does not depend on how the tables were stacked
or placed: loading fills tensors shaped as the *target's* state dict, which is what lets DCP
restore a checkpoint written by W processes into W' processes with another layout.

Atomicity. ``save`` writes into a temporary sibling ``<path>.tmp-<pid>-<random>``, fsyncs it, then
swaps it in: an existing ``<path>`` is renamed to ``<path>.old``, the temporary directory to
``<path>``, and ``<path>.old`` is removed. ``<path>`` therefore only ever appears complete; if a
writer is killed between the two renames, ``load(path)`` finds ``<path>.old``, the previous
checkpoint. A leftover temporary directory (a writer killed while writing) is never read; the
next ``save`` to the same path removes it once its writer's process is gone.

Safety. Loading never runs code stored in the files. DCP stores its index with ``pickle``; this
module reads it with a restricted unpickler that resolves only the few classes a DCP index holds
(``ALLOWED_METADATA_GLOBALS``: DCP's metadata dataclasses, ``torch.Size``, torch dtypes and
layouts, paths and plain builtins) and raises ``pickle.UnpicklingError`` naming any other. Tensor
bytes are read by DCP with ``torch.load(weights_only=True)``. Every key that is loaded must be a
tensor entry in the index: DCP would ``torch.load(weights_only=False)`` a non-tensor ("bytes")
entry, so such entries are refused, as are data files outside the checkpoint directory.
Files are read as the publish readers read theirs (``formats/published.py``: ``open_regular``):
``manifest.json`` and ``.metadata`` must be regular files in the directory (a symbolic link is
followed only to a file in it), opened without blocking, of at most ``FILE_BYTES``, read whole;
the data files a load reads are checked alike (and to hold the chunks read there) before DCP,
which follows links and blocks on a FIFO, opens them (``check_data_files``).
``manifest.json`` is plain JSON (finite numbers only); a table's sizes there must be integers
(else a ValueError saying the manifest is malformed), and an empty, truncated or undecodable
``.metadata`` is a ValueError saying the checkpoint is corrupt, naming the file.

Integrity. Flipped or lost bytes never load as wrong values (checkpoints with checksums, i.e.
written by this version on): ``manifest.json`` holds ``checksums`` = ``{"algorithm": "crc32",
"index": <CRC of .metadata>, "chunks": [{"file", "offset", "length", "key", "at", "crc32"}, ...],
"manifest": <CRC of the manifest's other fields>, "seal": <CRC of the rest>}``, the zlib CRC-32
(``formats/files.py``'s ``crc32``, as publish entries use) of every byte range DCP wrote, one
per saved chunk: a state-dict key (``key``) and the offsets of its chunk in the logical tensor
(``at``; a whole tensor, or a process's DTensor shard), where DCP's index says its bytes lie
(``file``, ``offset``, ``length``: the chunk as DCP serialized it, header included). Each process
computes, right after writing them (still in the page cache), the CRCs of the chunks it wrote
(replicated tensors are written by one process); every process then reads the index rank 0 wrote
(what ``dcp.save`` returns lacks it in some torch versions), the CRCs are all-gathered in its
order, and rank 0 adds the index's CRC and writes them to the manifest.

Why per saved chunk, of the file's bytes: a load may reshard (written by W processes, read by W'),
so a CRC of a whole logical tensor, or of the rows a process reads, cannot be checked by a process
that reads some of the rows of a chunk; a saved chunk is the unit DCP reads (whole, then narrowed),
so each process checks, before DCP reads anything, every chunk its load plan reads, whatever W and
W'. Checking the file's bytes rather than the decoded tensors also covers the serialization headers
(a damaged header cannot decode as other values) and needs no decoding. Load checks, in order: the
``checksums`` section against its ``seal`` and the manifest's other fields (tables, plan, step,
``extra``) against ``manifest``, as canonical JSON (a damaged manifest is named as such; a
checkpoint written before ``manifest`` was kept has only its checksums sealed), ``.metadata``
against ``index`` before unpickling it, that every chunk of the index has its entry (same key,
offsets and length), then each chunk it will read (every byte is read twice: by the check, mapped,
not copied, then by DCP, from the page cache). A mismatch is a ValueError naming the file, the key
and the chunk; with several processes DCP hands one process's error to all. Nothing is loaded then:
the target is changed only after every read succeeded. A partial load (``tables=``, ``slots=False``)
checks the chunks it reads, not the others.

Cost: one CRC pass over the bytes written or read (about 3.5 GB/s): for a 1M x 64 float32 table with
Adagrad (488 MiB, in the page cache; medians on a 16-core machine) save 0.59 -> 0.80 s and load 0.46
-> 0.58 s (a CUDA engine: 0.55 -> 0.74 s, 0.34 -> 0.52 s). CRC-32 finds accidental damage (flipped,
lost or stale bytes), not tampering: whoever can write the files can rewrite the checksums, so
crafted files remain the restricted unpickler's business. Checkpoints written before checksums
existed (no ``checksums`` in the manifest) load as before, unverified; the format version is
unchanged (1): readers that predate checksums ignore the extra manifest key.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import pickle
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ..base.compat import (
    DCP_INDEX,
    DCP_INDEX_PRIVATE_GLOBALS,
    PICKLED_PATH_MODULES,
    dcp_index_name,
)
from .files import crc32, fsync_dir, pid_alive
from .published import loads_finite, open_regular, read_exactly

FORMAT = "embcore.checkpoint"


FORMAT_VERSION = 1


MANIFEST = "manifest.json"


CHECKSUMS = "checksums"  # the manifest's key for the chunks' CRCs (module docstring: Integrity)


CHECKSUM_ALGORITHM = "crc32"


METADATA = DCP_INDEX  # DCP's index file (".metadata")


FILE_BYTES = 1 << 30  # a manifest.json or .metadata larger than this is refused unread


_DCP_METADATA = "torch.distributed.checkpoint.metadata"


# (module, name) pairs the metadata unpickler resolves; torch dtypes are allowed besides (below).
# The private ones (two DCP classes, and the function that maps "torch.strided" to the layout
# object) are declared in compat.py: DCP_INDEX_PRIVATE_GLOBALS.
ALLOWED_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [(_DCP_METADATA, n) for n in ("Metadata", "MetadataIndex", "ChunkStorageMetadata",
                                  "TensorStorageMetadata", "TensorProperties", "StorageMeta")]
    + list(DCP_INDEX_PRIVATE_GLOBALS)
    + [("torch", "Size"),
       ("collections", "OrderedDict")]
    + [(m, n) for m in PICKLED_PATH_MODULES  # StorageMeta.checkpoint_id
       for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                 "PureWindowsPath")]
    + [("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float",
                                 "str", "bool", "slice")])


class RefusedGlobalError(pickle.UnpicklingError):
    """The restricted unpickler refused what a checkpoint index asked for (a class it does not
    allow, a persistent id): a crafted file, kept apart from merely corrupt ones."""


class RestrictedMetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` index, resolving only ``ALLOWED_METADATA_GLOBALS`` and torch
    dtypes; anything else (``os.system``, ``builtins.eval``, ...) is refused before it is looked
    up, so a crafted index cannot run code.

    Raises:
        RefusedGlobalError: (a ``pickle.UnpicklingError``) naming the refused ``module.name``.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedGlobalError(
            f"checkpoint metadata refers to {module}.{name}, which is not a class a "
            f"torch.distributed.checkpoint index holds; refusing to load it (the file may have "
            f"been tampered with)")

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedGlobalError("checkpoint metadata holds a persistent id; refusing it")


@functools.cache
def dcp_io() -> SimpleNamespace:
    """torch.distributed.checkpoint and our reader / planner, imported on first use.

    (Importing DCP takes about a second, more than the rest of embcore; ``import embcore`` should
    not pay it.)
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    class ChecksummingWriter(FileSystemWriter):
        """FileSystemWriter that, once this process's files are written, computes the CRC of
        each chunk's bytes in them: ``sums[(file, offset)] = (length, crc)``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.sums: dict[tuple[str, int], tuple[int, int]] = {}

        def write_data(self, plan: Any, planner: Any) -> Any:
            written = super().write_data(plan, planner)
            for result in written.wait():  # (FileSystemWriter's future is complete already)
                info = result.storage_data
                rel, offset, length = str(info.relative_path), int(info.offset), int(info.length)
                self.sums[(rel, offset)] = (length, range_crc(Path(self.path) / rel, offset,
                                                               length))
            return written

    class SafeReader(FileSystemReader):
        """FileSystemReader whose index is read by the restricted unpickler and checked, and
        which, given the manifest's ``checksums``, verifies the index and every chunk it is
        about to read (module docstring: Integrity)."""

        def __init__(self, path: Path, checksums: Checksums | None = None) -> None:
            super().__init__(path)
            self.checksums = checksums
            self.chunks: Mapping[Any, Any] = {}

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")
            path = Path(self.path) / dcp_index_name(rank)
            raw = read_file(path, Path(self.path))
            if not raw:
                raise ValueError(f"{path} is empty: the checkpoint is corrupt")
            if self.checksums is not None and crc_of_bytes(raw) != self.checksums.index:
                raise ValueError(f"{path} does not match its CRC-32 in {MANIFEST}: the checkpoint "
                                 f"is corrupt (its index was damaged or replaced)")
            try:
                md = RestrictedMetadataUnpickler(io.BytesIO(raw)).load()
            except RefusedGlobalError:
                raise
            except Exception as e:  # EOFError, truncated data, garbage: all a corrupt index
                raise ValueError(f"{path} is truncated or corrupt ({type(e).__name__}: "
                                 f"{str(e)[:200]}): the checkpoint is corrupt") from e
            if not isinstance(md, Metadata):
                raise pickle.UnpicklingError(f"{path} holds a {type(md).__name__}, not a "
                                             f"torch.distributed.checkpoint Metadata")
            if not all(isinstance(x, dict) for x in (md.storage_data, md.state_dict_metadata)):
                raise ValueError(f"{path} lacks its storage or key index: the checkpoint is "
                                 f"corrupt")
            check_index(md, path)
            for info in md.storage_data.values():
                rel = info.relative_path
                if not rel or rel != os.path.basename(rel) or rel in (".", ".."):
                    raise ValueError(f"checkpoint index points at {rel!r}, outside its "
                                     f"directory; refusing to read it")
                if getattr(info, "transform_descriptors", None):
                    raise ValueError(f"checkpoint index asks for stream transforms "
                                     f"{info.transform_descriptors}; embcore writes none")
            if self.checksums is not None:
                self.checksums.match_index(md.storage_data, path)
            storage_meta = getattr(md, "storage_meta", None)
            if storage_meta is not None:  # as DCP's reader does (compat.py)
                storage_meta.load_id = self.load_id
            return md

        def set_up_storage_reader(self, metadata: Metadata, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_reader(metadata, *args, **kwargs)
            self.chunks = metadata.storage_data

        def read_data(self, plan: Any, planner: Any) -> Any:
            # Every file this process reads is checked (a regular file in the directory that
            # holds its chunks: check_data_files), and every chunk verified, before any is read
            # (the target is only filled once every read succeeded anyway: load()).
            check_data_files(Path(self.path), [(item.storage_index,
                                                self.chunks[item.storage_index])
                                               for item in plan.items])
            if self.checksums is not None:
                seen: set[tuple[str, int]] = set()
                for item in plan.items:
                    info = self.chunks[item.storage_index]
                    where = (str(info.relative_path), int(info.offset))
                    if where not in seen:
                        seen.add(where)
                        self.checksums.verify(Path(self.path), item.storage_index, info)
            return super().read_data(plan, planner)

    class TensorOnlyLoadPlanner(DefaultLoadPlanner):
        """DCP's planner, minus ``load_bytes`` (which would ``torch.load(weights_only=False)``)."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise ValueError(f"checkpoint entry {read_item.dest_index.fqn!r} is stored as "
                             f"pickled bytes, not a tensor; refusing to unpickle it")

    def check_index(md: Metadata, path: Path) -> None:
        """The index's entries have the types DCP's reader uses (names strings, places and
        shapes integers, dtypes torch dtypes), so that no later step meets another kind (or a
        value nested too deep to print). Raises ValueError naming the file and the entry."""
        def bad(what: Any) -> ValueError:
            shown = f"a {type(what).__name__}" if not isinstance(what, str) else repr(what[:60])
            return ValueError(f"{path} holds an entry of another kind than DCP writes "
                              f"({shown}): the checkpoint is corrupt")

        def sizes(x: Any) -> bool:
            return type(x) is torch.Size

        for index, info in md.storage_data.items():
            if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str)
                    and (index.offset is None or sizes(index.offset))):
                raise bad(index)
            if not (isinstance(getattr(info, "relative_path", None), str) and all(
                    type(getattr(info, k, None)) is int and getattr(info, k) >= 0
                    for k in ("offset", "length"))):
                raise bad(info)
        for key, entry in md.state_dict_metadata.items():
            if not isinstance(key, str):
                raise bad(key)
            if isinstance(entry, BytesStorageMetadata):
                continue
            if not (isinstance(entry, TensorStorageMetadata) and sizes(entry.size)
                    and isinstance(entry.properties, TensorProperties)
                    and isinstance(entry.properties.dtype, torch.dtype)
                    and isinstance(entry.chunks, list)
                    and all(isinstance(c, ChunkStorageMetadata) and sizes(c.offsets)
                            and sizes(c.sizes) for c in entry.chunks)):
                raise bad(key)

    return SimpleNamespace(dcp=dcp, Writer=ChecksummingWriter, Reader=SafeReader,
                           Planner=TensorOnlyLoadPlanner, TensorMD=TensorStorageMetadata,
                           CheckpointException=CheckpointException)


# --------------------------------------------------------------------------------- files
def open_inside(path: Path, directory: Path) -> int:
    """A read-only descriptor of the checkpoint file ``path``: a regular file in ``directory``
    (a symbolic link is followed only to a file in the directory), opened without blocking
    (``formats.published.open_regular``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a link leading out of the directory, a FIFO, a device, a directory, ...
    """
    root, real = os.path.realpath(directory), os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ValueError(f"{path} is a symbolic link to {real}, outside the checkpoint "
                         f"directory {directory}; a checkpoint's files lie in its directory "
                         f"(copy the file in rather than linking to it)")
    return open_regular(Path(real), ValueError, "a checkpoint's")


def read_file(path: Path, directory: Path, limit: int = FILE_BYTES) -> bytes:
    """The bytes of the checkpoint file ``path`` (``open_inside``), at most ``limit``.

    Raises:
        FileNotFoundError: no such file. ValueError: not a regular file in the directory,
            larger than ``limit`` (naming both), or truncated while it is read.
    """
    fd = open_inside(path, directory)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ValueError(f"{path} is {size} bytes, more than the {limit} a checkpoint's "
                             f"{path.name} may take: the checkpoint is corrupt (or not one)")
        return read_exactly(fd, size, path, ValueError)
    finally:
        os.close(fd)


def read_manifest(directory: Path) -> Any:
    """The decoded ``manifest.json`` of the checkpoint ``directory`` (``read_file``): JSON of
    finite numbers (``ec.save`` writes no NaN or infinity).

    Raises:
        ValueError: not a regular file in the directory, too large, not JSON, holding ``NaN``,
            ``Infinity``, ``1e999`` or an integer of more than Python's 4300 digits, or nested
            too deep; naming the file.
    """
    path = directory / MANIFEST
    raw = read_file(path, directory)
    try:
        return loads_finite(raw, int64=False)
    except (ValueError, RecursionError) as e:  # (JSONDecodeError, UnicodeDecodeError, ours)
        raise ValueError(f"{path} is not valid JSON ({str(e)[:200]}): the checkpoint is "
                         f"corrupt") from None


def check_data_files(directory: Path, chunks: list[tuple[Any, Any]]) -> None:
    """The data files holding ``chunks`` (``(index, storage info)`` pairs from DCP's index)
    are regular files in ``directory`` (``open_inside``) that hold each chunk's bytes, before
    DCP opens them (it follows links and would block on a FIFO).

    Raises:
        FileNotFoundError: a file is missing. ValueError: a link leading out, a FIFO, ..., or a
            chunk ending past its file's end, naming the file, the key and the chunk.
    """
    sizes: dict[str, int] = {}
    for index, info in chunks:
        rel = str(info.relative_path)
        if rel not in sizes:
            try:
                fd = open_inside(directory / rel, directory)
            except FileNotFoundError:
                raise FileNotFoundError(f"{directory / rel} is missing: the checkpoint is "
                                        f"incomplete") from None
            try:
                sizes[rel] = os.fstat(fd).st_size
            finally:
                os.close(fd)
        offset, length = int(info.offset), int(info.length)
        if offset + length > sizes[rel]:
            raise ValueError(f"{directory / rel}: checkpoint entry {index.fqn!r} (its chunk at "
                             f"offsets {[int(a) for a in index.offset]}, bytes {offset}.."
                             f"{offset + length}) ends past the file's {sizes[rel]} bytes: the "
                             f"checkpoint is corrupt or truncated")


# --------------------------------------------------------------------------------- checksums
def range_crc(path: Path, offset: int, length: int) -> int:
    """CRC-32 (``formats.files.crc32``) of ``length`` bytes of the file ``path`` from ``offset``,
    mapped, not copied into memory."""
    if length == 0:
        return 0
    # (a copy-on-write mapping: never written)
    return crc32(np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(length,)))


def crc_of_bytes(data: bytes) -> int:
    """CRC-32 (``formats.files.crc32``) of ``data``."""
    return crc32(data)


def manifest_crc(manifest: Mapping[str, Any]) -> int:
    """The CRC of a manifest's fields but its checksums, as canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUMS}
    return crc_of_bytes(json.dumps(body, sort_keys=True, separators=(",", ":"),
                                   ensure_ascii=True, allow_nan=False).encode("ascii"))


def seal_of(section: Mapping[str, Any]) -> int:
    """The CRC of a checksums section (all but its ``seal``), as canonical JSON."""
    body = {k: v for k, v in section.items() if k != "seal"}
    return crc_of_bytes(json.dumps(body, sort_keys=True, separators=(",", ":"),
                                   ensure_ascii=True).encode("ascii"))


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A saved chunk's entry in the manifest: its key and offsets, its bytes and their CRC."""

    file: str
    offset: int
    length: int
    key: str
    at: tuple[int, ...]
    crc32: int

    def describe(self) -> str:
        return (f"checkpoint entry {self.key!r} (its chunk at offsets {list(self.at)}, bytes "
                f"{self.offset}..{self.offset + self.length})")


@dataclasses.dataclass(frozen=True)
class Checksums:
    """A checkpoint's ``checksums`` (module docstring: Integrity), as load checks them."""

    manifest: Path
    index: int
    chunks: Mapping[tuple[str, int], Chunk]  # by (file, offset)

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], path: Path) -> Checksums | None:
        """The manifest's checksums, checked against their seal; None when it has none (a
        checkpoint written before checksums existed).

        Raises:
            ValueError: malformed (naming the key and what it holds), an unknown algorithm, or
                a section that does not match its seal (the manifest is corrupt).
        """
        if CHECKSUMS not in manifest:
            return None
        section = manifest[CHECKSUMS]

        def malformed(where: str, value: Any, want: str) -> ValueError:
            return ValueError(f"{path} is malformed: {where} is {type(value).__name__} "
                              f"{str(value)[:60]!r}, not {want}")

        def integer(where: str, value: Any, bound: int) -> int:
            if type(value) is not int or not 0 <= value < bound:
                raise malformed(where, value, f"an integer in [0, {bound})")
            return value

        if not isinstance(section, dict):
            raise malformed(repr(CHECKSUMS), section, "an object")
        if section.get("algorithm") != CHECKSUM_ALGORITHM:
            raise ValueError(f"{path}: checksums computed with {section.get('algorithm')!r}; "
                             f"this embcore knows {CHECKSUM_ALGORITHM!r}")
        seal = integer(f"{CHECKSUMS}['seal']", section.get("seal"), 2**32)
        index = integer(f"{CHECKSUMS}['index']", section.get("index"), 2**32)
        entries = section.get("chunks")
        if not isinstance(entries, list):
            raise malformed(f"{CHECKSUMS}['chunks']", entries, "a list")
        chunks: dict[tuple[str, int], Chunk] = {}
        for i, e in enumerate(entries):
            where = f"{CHECKSUMS}['chunks'][{i}]"
            if not isinstance(e, dict) or set(e) != {f.name for f in dataclasses.fields(Chunk)}:
                raise malformed(where, e, "an object of file, offset, length, key, at, crc32")
            for k in ("file", "key"):
                if not isinstance(e[k], str):
                    raise malformed(f"{where}[{k!r}]", e[k], "a string")
            if not isinstance(e["at"], list):
                raise malformed(f"{where}['at']", e["at"], "a list")
            chunk = Chunk(e["file"], integer(f"{where}['offset']", e["offset"], 2**63),
                          integer(f"{where}['length']", e["length"], 2**63), e["key"],
                          tuple(integer(f"{where}['at']", a, 2**63) for a in e["at"]),
                          integer(f"{where}['crc32']", e["crc32"], 2**32))
            if (chunk.file, chunk.offset) in chunks:
                raise ValueError(f"{path} is malformed: {where} repeats the chunk at "
                                 f"{chunk.file}, byte {chunk.offset}")
            chunks[(chunk.file, chunk.offset)] = chunk
        if seal != seal_of(section):
            raise ValueError(f"{path}: its {CHECKSUMS!r} do not match their own CRC-32 ('seal'): "
                             f"{MANIFEST} is corrupt")
        if "manifest" in section:  # (written since the manifest's own fields were sealed)
            want = integer(f"{CHECKSUMS}['manifest']", section["manifest"], 2**32)
            if want != manifest_crc(manifest):
                raise ValueError(f"{path}: its fields (tables, plan, step, extra, ...) do not "
                                 f"match their CRC-32 ({CHECKSUMS}['manifest']): {MANIFEST} is "
                                 f"corrupt")
        return cls(path, index, chunks)

    def _entry(self, index: Any, info: Any, where: Path) -> Chunk:
        """The entry of the index's chunk ``index`` stored at ``info``, which must agree."""
        rel, offset, length = str(info.relative_path), int(info.offset), int(info.length)
        chunk = self.chunks.get((rel, offset))
        if chunk is None or (chunk.key, chunk.at, chunk.length) != (
                index.fqn, tuple(int(a) for a in index.offset), length):
            raise ValueError(f"{where}: the chunk of {index.fqn!r} at offsets "
                             f"{[int(a) for a in index.offset]} ({rel}, bytes {offset}.."
                             f"{offset + length}) has no checksum in {self.manifest}: the "
                             f"index and the manifest disagree; the checkpoint is corrupt")
        return chunk

    def match_index(self, storage: Mapping[Any, Any], where: Path) -> None:
        """Every chunk of DCP's index (``storage_data``) has its entry, and no other is listed."""
        for index, info in storage.items():
            self._entry(index, info, where)
        if len(storage) != len(self.chunks):
            raise ValueError(f"{where} lists {len(storage)} chunks but {self.manifest} has "
                             f"checksums of {len(self.chunks)}: the checkpoint is corrupt")

    def verify(self, directory: Path, index: Any, info: Any) -> None:
        """Checks the bytes of the index's chunk ``index`` (stored at ``info``) against its CRC.

        Raises:
            ValueError: naming the file, the key and the chunk: its bytes differ, the file is
                shorter, or the chunk has no entry.
        """
        chunk = self._entry(index, info, directory / METADATA)
        file = directory / chunk.file
        size = file.stat().st_size
        if size < chunk.offset + chunk.length:
            raise ValueError(f"{file}: {chunk.describe()} ends past the file's {size} bytes: the "
                             f"checkpoint is corrupt or truncated")
        if range_crc(file, chunk.offset, chunk.length) != chunk.crc32:
            raise ValueError(f"{file}: {chunk.describe()} does not match its CRC-32 in "
                             f"{self.manifest}: the checkpoint is corrupt")


def remove_stale_temporaries(path: Path) -> None:
    """Removes ``<path>.tmp-<pid>-<token>`` directories of writers that died on this machine (their
    pid no longer runs): what a killed save leaves. A live writer's directory is kept."""
    for tmp in path.parent.glob(f"{path.name}.tmp-*-*") if path.parent.is_dir() else ():
        pid = tmp.name[len(path.name) + len(".tmp-"):].split("-", 1)[0]
        if not pid.isdigit() or not tmp.is_dir():
            continue
        if not pid_alive(int(pid)):  # (a live writer's, or one that cannot be told: kept)
            remove_tree(tmp, missing_ok=True)


def swap_in(tmp: Path, path: Path) -> None:
    """Makes the complete directory ``tmp`` the checkpoint ``path``, keeping the previous one
    loadable at every instant (as ``path``, or as ``path.old`` between the two renames)."""
    old = old_path(path)
    if path.exists():
        # path only ever appears complete, so a leftover .old (a writer killed while removing
        # it) is stale; when path is absent, .old is the latest checkpoint and stays until the
        # new one is in place.
        remove_tree(old, missing_ok=True)
        replace_dir(path, old)
    replace_dir(tmp, path)
    fsync_dir(path.parent)
    remove_tree(old, missing_ok=True)


# File-system steps as module functions, so tests can interrupt a save between any two of them.
def replace_dir(src: Path, dst: Path) -> None:
    os.replace(src, dst)


def remove_tree(p: Path, missing_ok: bool = False) -> None:
    if missing_ok and not p.exists():
        return
    shutil.rmtree(p)


def old_path(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def is_checkpoint(p: Path) -> bool:
    return (p / MANIFEST).is_file() and (p / METADATA).is_file()


def check_manifest(manifest: Mapping[str, Any], path: Path) -> None:
    """The manifest's entries that load uses have their types (a hand-edited or damaged manifest
    is named as malformed, not mistaken for another checkpoint)."""

    def malformed(where: str, value: Any, want: str) -> ValueError:
        return ValueError(f"{path} is malformed: {where} is {type(value).__name__} "
                          f"{str(value)[:60]!r}, not {want}")

    version = manifest.get("format_version", 0)
    if type(version) is not int:
        raise malformed("format_version", version, "an int")
    tables = manifest.get("tables", {})
    if not isinstance(tables, dict):
        raise malformed("tables", tables, "an object")
    for name, entry in tables.items():
        if not isinstance(entry, dict):
            raise malformed(f"tables[{name!r}]", entry, "an object")
        for k in ("vocabulary_size", "dim"):
            if type(entry.get(k)) is not int:
                raise malformed(f"tables[{name!r}][{k!r}]", entry.get(k), "an int")
        if entry.get("dynamic") is not None and not isinstance(entry["dynamic"], dict):
            raise malformed(f"tables[{name!r}]['dynamic']", entry["dynamic"], "an object or null")


def resolve_dir(path: Path) -> Path:
    """The directory to read: ``path``, or ``path.old`` left by a save killed mid-swap."""
    if path.exists():
        if not is_checkpoint(path):
            raise FileNotFoundError(f"{path} is not an embcore checkpoint: it lacks "
                                    f"{MANIFEST} or {METADATA}")
        return path
    if is_checkpoint(old_path(path)):
        return old_path(path)
    raise FileNotFoundError(f"no checkpoint at {path} (nor a previous one at {old_path(path)})")
