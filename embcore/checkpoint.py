"""Checkpoints: ``ec.save(path, obj)`` / ``ec.load(path, obj)`` for an Embedding or EmbeddingLayer.

The directory's format (DCP's files and ``manifest.json``), its atomic swap, the restricted
unpickler of DCP's index and the CRC-32 of every saved chunk are ``formats/checkpoint.py``'s. This
module is the shell over it: ``save`` writes an object's ``state_dict()`` with
``torch.distributed.checkpoint`` into a temporary directory, gathers every process's checksums
and swaps the directory in; ``load`` checks the manifest against the target, reads what it asks
for (every chunk checked first) and fills the target only after every read succeeded.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .base.comm import CollectiveError, everywhere
from .base.compat import DCP_NO_PROCESS_GROUP_WARNING
from .config.dtypes import SCALED, SCALES
from .engine import Embedding
from .formats.checkpoint import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    METADATA,
    Checksums,
    check_manifest,
    crc_of_bytes,
    dcp_io,
    is_checkpoint,
    manifest_crc,
    read_manifest,
    remove_stale_temporaries,
    remove_tree,
    resolve_dir,
    seal_of,
    swap_in,
)
from .formats.files import agreed_token, complete_dir
from .formats.published import is_publish_dir
from .layer import EmbeddingLayer, engine_of
from .numerics.rounding import COMPACT, narrowed, quantize, widen, wider
from .online import resume
from .state.tier.files import saving


def _gather_checksums(engine: Embedding, storage: Mapping[Any, Any],
                      mine: Mapping[tuple[str, int], tuple[int, int]]) -> list[dict[str, Any]]:
    """Every chunk's manifest entry, in the index's order (a collective when sharded).

    Each process has the CRCs of the chunks it wrote (``mine``: (file, offset) -> (length,
    crc)) and every process the index DCP wrote (``storage``: its ``storage_data``, the same
    everywhere): each contributes an int64 vector over the index's chunks (its CRC, or -1 for
    chunks others wrote), all-gathered; a chunk's CRC is the one process's that wrote it.
    """
    order = sorted(storage.items(),
                   key=lambda kv: (str(kv[1].relative_path), int(kv[1].offset)))
    where = [(str(info.relative_path), int(info.offset)) for _, info in order]
    own = torch.tensor([len(mine)] + [mine[w][1] if w in mine else -1 for w in where],
                       dtype=torch.int64)
    gathered = torch.stack([g.cpu() for g in engine.comm.all_gather(own.to(engine.device))])
    sums = gathered[:, 1:].amax(0).tolist() if where else []
    if int(gathered[:, 0].sum()) != len(where) or any(c < 0 for c in sums):
        raise RuntimeError(f"embcore: the processes computed checksums of "
                           f"{int(gathered[:, 0].sum())} chunks, but DCP's index lists "
                           f"{len(where)}; the checkpoint is not written")
    return [{"file": rel, "offset": offset, "length": int(info.length), "key": index.fqn,
             "at": [int(a) for a in index.offset], "crc32": c}
            for (index, info), (rel, offset), c in zip(order, where, sums)]


# --------------------------------------------------------------------------------- the object
def _engine_and_state(obj: Any, call: str) -> tuple[Embedding, dict[str, torch.Tensor], bool]:
    """(engine, the state dict to save / fill, whether obj is a V0 layer)."""
    engine = engine_of(obj, call)
    if isinstance(obj, EmbeddingLayer) and obj.tables_are_parameters:
        # the layer's nn.Parameters (the engine's are unused), by table, not by the module's
        # state_dict: a TorchRec module names them its way
        return engine, {f"{n}/parameters": obj.embedding_tables[t].detach()
                        for t, n in engine.table_names().items()}, True
    return engine, engine.state_dict(), False


def _group(comm: Any) -> Any:
    """The process group DCP coordinates on: the communicator's, with its timeout (comm.py)."""
    return comm.checkpoint_group() if comm.world_size > 1 else None


@contextlib.contextmanager
def _dcp_call(what: str, world_size: int = 1) -> Iterator[None]:
    """Runs a DCP call: silences its warning that no process group is used (W = 1), and
    re-raises the error DCP wraps in its ``CheckpointException`` (a BaseException, which
    ``except Exception`` would miss) as itself, or, for a decoding error, as a ValueError saying
    that the checkpoint is corrupt; a failed collective with several processes becomes a
    ``CollectiveError``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DCP_NO_PROCESS_GROUP_WARNING,
                                category=UserWarning)
        try:
            yield
        except dcp_io().CheckpointException as e:
            errors = [exc for exc, _ in e.failures.values()]
            if not errors:
                raise RuntimeError(f"{what} failed: {e}") from e
            first = errors[0]
            if (isinstance(first, (ValueError, OSError, pickle.UnpicklingError, MemoryError))
                    and not isinstance(first, UnicodeError)) or not isinstance(first, Exception):
                raise first from e  # (a UnicodeDecodeError is a corrupt file: reworded below)
            raise ValueError(f"{what} failed: the checkpoint is corrupt or truncated "
                             f"({type(first).__name__}: {first})") from first
        except RuntimeError as e:  # a collective of DCP's failed: another process died or stalls
            if world_size == 1 or isinstance(e, CollectiveError):
                raise
            raise CollectiveError(f"embcore: {what} failed in a collective of "
                                  f"torch.distributed.checkpoint ({world_size} processes): "
                                  f"another process probably died or stalls. Cause: "
                                  f"{type(e).__name__}: {str(e)[:300]}") from e


def _agreed_token(engine: Embedding) -> str:
    """A fresh name suffix, the same on every process (rank 0's)."""
    return agreed_token(engine.comm, engine.device)


def _all_ok(engine: Embedding, ok: bool) -> bool:
    """Whether ``ok`` holds on every process (a collective when sharded)."""
    return everywhere(engine.comm, ok, engine.device)


# --------------------------------------------------------------------------------- save
def save(path: str | os.PathLike[str], obj: Embedding | EmbeddingLayer, *,
         extra: dict[str, Any] | None = None) -> None:
    """Writes ``obj``'s tables, optimizer slots and step to the checkpoint directory ``path``.

    The write is atomic: ``path`` is replaced only once the new checkpoint is complete on disk,
    and a writer killed at any point leaves the previous checkpoint loadable (see the module
    docstring). Parent directories are created. When the engine is sharded, every process
    calls ``save`` with the same ``path`` on a file system they share; each writes its own
    shards, and rank 0 the index and manifest.

    Args:
        path: the checkpoint directory; an existing checkpoint there is replaced.
        obj: an ``ec.Embedding`` or ``ec.EmbeddingLayer`` (with ``optimizer=None`` its
            ``nn.Parameter`` tables are saved; there are no slots and no step).
        extra: JSON-able user metadata (epoch, metrics, ...), stored in ``manifest.json`` and
            returned by ``load`` under ``"extra"``.

    Raises:
        TypeError: ``obj`` is not an Embedding / EmbeddingLayer, or ``extra`` is not a JSON-able
            dict.
        FileExistsError: ``path`` exists and is neither an embcore checkpoint nor empty.

    Example:
        >>> import tempfile, torch, embcore as ec
        >>> t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
        >>> emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.Adagrad(learning_rate=0.1))
        >>> d = tempfile.mkdtemp()
        >>> ec.save(f"{d}/ckpt", emb, extra={"epoch": 3})
        >>> ec.load(f"{d}/ckpt", emb)["extra"]
        {'epoch': 3}
    """
    with saving():  # (offloaded rows checked; read through the tier's open files)
        engine, state, v0 = _engine_and_state(obj, "ec.save")  # a collective when sharded
    comm = engine.comm
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict of JSON-able values or None, got "
                        f"{type(extra).__name__}")
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION,
                "object": type(obj).__name__ + (" (optimizer=None)" if v0 else ""),
                **engine.manifest(), "keys": sorted(state), "extra": extra or {}}
    if v0:
        manifest["step"] = None  # a V0 layer's tables are trained by the user's optimizer
    try:
        json.dumps(manifest, allow_nan=False)  # (written with its checksums once they are known)
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must hold only JSON values (dict, list, str, int, finite float, "
                        f"bool, None): {e}") from e

    # Every process checks the (shared) file system alike, so all raise or none does.
    path = Path(os.fspath(path))
    if path.exists() and not is_checkpoint(path) and not (path.is_dir() and
                                                           not any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an embcore checkpoint; refusing to "
                              f"replace it (choose another path or remove it)")
    tmp = path.with_name(f"{path.name}.tmp-{_agreed_token(engine)}")
    lead = comm.rank == 0  # creates the directory, writes the manifest and swaps it in
    error: BaseException | None = None
    if lead:
        remove_stale_temporaries(path)
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            error = e
    if not _all_ok(engine, error is None):  # every process raises, none waits for the others
        raise error or RuntimeError(f"rank 0 could not create {tmp}; see its error")
    try:
        d = dcp_io()
        # each process writes its shards and their checksums; rank 0 the index
        writer = d.Writer(tmp, sync_files=True)
        with _dcp_call(f"writing {tmp}", comm.world_size):
            d.dcp.save(state, storage_writer=writer, process_group=_group(comm),
                       no_dist=comm.world_size == 1)
        # The index as written (what dcp.save returns lacks storage_data in some torch versions)
        storage, failed = None, None
        try:
            storage = d.Reader(tmp).read_metadata().storage_data
        except Exception as e:  # re-raised below, once every process knows
            failed = e
        if not _all_ok(engine, failed is None):
            raise failed or RuntimeError(f"another process could not read the index of {tmp}; "
                                         f"see its error")
        chunks = _gather_checksums(engine, storage or {}, writer.sums)  # the same everywhere
    except BaseException:
        if lead:
            remove_tree(tmp, missing_ok=True)
        raise
    if lead:
        try:
            section = {"algorithm": CHECKSUM_ALGORITHM,
                       "index": crc_of_bytes((tmp / METADATA).read_bytes()), "chunks": chunks,
                       "manifest": manifest_crc(manifest)}
            manifest[CHECKSUMS] = {**section, "seal": seal_of(section)}
            complete_dir(tmp, MANIFEST, json.dumps(manifest, indent=1, allow_nan=False))
            swap_in(tmp, path)
        except BaseException as e:  # re-raised below, after telling the other processes
            remove_tree(tmp, missing_ok=True)
            error = e
    if not _all_ok(engine, error is None):
        raise error or RuntimeError(f"rank 0 failed to complete the checkpoint {path}; see its "
                                    f"error")


# --------------------------------------------------------------------------------- load
def load(path: str | os.PathLike[str], obj: Embedding | EmbeddingLayer, *,
         tables: Sequence[str] | None = None, slots: bool = True,
         strict: bool = True, saturate: bool = False) -> dict[str, Any]:
    """Restores tables (and optimizer slots and step) from a checkpoint into ``obj``, in place.

    The checkpoint may come from another object with the same tables (another stacking, device,
    optimizer or layer kind). ``obj`` is changed only once everything is read and checked
    (every chunk read against its CRC-32 in the manifest: module docstring, Integrity): any
    error leaves it untouched. Tensors are copied onto ``obj``'s device and dtype. When the
    engine is sharded, every process calls ``load``; each reads the rows of its shards, whatever
    the layout and world size the checkpoint was written with.

    Args:
        path: a directory written by ``ec.save``. If it does not exist but ``<path>.old`` does
            (a save killed between its renames), that previous checkpoint is loaded. A
            directory ``ec.publish`` writes to is read as its newest published state
            (online.py ``resume``: resume training from it when published with
            ``slots=True``; ``slots=False`` for its parameters).
        obj: the ``ec.Embedding`` or ``ec.EmbeddingLayer`` to fill.
        tables: names of the tables to load (a partial restore; the others are untouched).
            None: all of ``obj``'s tables.
        slots: False loads parameters only (serving, or a fresh optimizer). Slots are skipped
            anyway for tables that have none in ``obj`` (no optimizer, SGD, a V0 layer).
        strict: with True, a table of ``obj`` missing from the checkpoint (when ``tables`` is
            None), or a slot of ``obj`` missing from it, is a KeyError; False skips them.
            The step is restored only when every table is loaded with all its slots.
        saturate: a narrowing load (a checkpoint's or a publish directory's float32 rows
            into a float16 or bfloat16 table, or bfloat16 rows into a float16 one) rounds to
            nearest; a finite value that
            would round to infinity (float16: ``|x| >= 65520``) is refused (ValueError) unless
            ``saturate`` is True, which stores the dtype's largest finite value of its sign
            instead (float16: +-65504). Infinities and NaN stay as they are either way.
            An 8-bit table's rows (float8_e4m3fn, float8_e5m2) load with their scales (always,
            ``slots=False`` too); into a table of another dtype they are widened (``code *
            scale``) and converted as above, and any table's rows load into an 8-bit table
            quantized to nearest with new scales (docs/semantics.md section 14).

    Returns:
        The checkpoint's manifest: ``{"format", "format_version", "embcore_version", "step",
        "tables": {name: {vocabulary_size, dim, combiner, dtype, optimizer, slots}}, "features",
        "plan", "world_size", "keys", "extra", "checksums", ...}`` (no ``checksums`` in a
        checkpoint written before them, which loads unverified).

    Raises:
        FileNotFoundError: ``path`` (and ``<path>.old``) is not a checkpoint.
        ValueError: ``tables`` names a table the checkpoint or ``obj`` lacks; a table's
            vocabulary_size / dim differs between checkpoint and ``obj``; an optimizer slot of
            another shape (another optimizer, e.g. Adagrad's into RowwiseAdagrad: naming both
            and ``slots=False``); a corrupt or
            truncated checkpoint: bytes that do not match their checksum (naming the file, the
            key and the chunk), an empty or truncated index, a malformed manifest (naming the
            entry and its type), a file that is not a regular file in the checkpoint's directory
            (a FIFO, a link leading out) or a manifest or index of more than 1 GiB (naming
            it: module docstring of formats/checkpoint.py); a narrowing load of a value out
            of the table dtype's range without ``saturate`` (naming the table, its rows and
            the largest value).
        KeyError: with ``strict``, a table or slot of ``obj`` that the checkpoint lacks.
        pickle.UnpicklingError: the index refers to anything but DCP's metadata classes.

    Example:
        >>> import tempfile, torch, embcore as ec
        >>> t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
        >>> emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.Adagrad(learning_rate=0.1))
        >>> d = tempfile.mkdtemp(); ec.save(f"{d}/ckpt", emb)
        >>> serving = ec.Embedding({"f": ec.FeatureConfig(table=t)})   # no optimizer, no slots
        >>> ec.load(f"{d}/ckpt", serving, slots=False)["tables"]["t"]["dim"]
        4
    """
    if is_publish_dir(Path(os.fspath(path))):  # ec.publish's directory: resume from it
        if tables is not None:
            raise ValueError("tables= is not supported when loading a publish directory; it "
                             "restores every table")
        return resume(Path(os.fspath(path)), obj, slots=slots, strict=strict,
                      saturate=saturate)
    engine, target, v0 = _engine_and_state(obj, "ec.load")  # a collective when sharded
    comm = engine.comm
    ckpt = resolve_dir(Path(os.fspath(path)))
    manifest = read_manifest(ckpt)  # (a regular file in it, of at most FILE_BYTES)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{ckpt} is not an embcore checkpoint (manifest.json has no "
                         f"format {FORMAT!r})")
    check_manifest(manifest, ckpt / MANIFEST)
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{ckpt} has format version {manifest['format_version']}; this embcore "
                         f"({manifest.get('embcore_version')}) reads up to {FORMAT_VERSION}")
    checksums = Checksums.from_manifest(manifest, ckpt / MANIFEST)  # None: written before them
    d = dcp_io()
    index = d.Reader(ckpt, checksums).read_metadata().state_dict_metadata  # {key: storage md}

    own_tables = engine.manifest()["tables"]
    keys = _keys_to_load(manifest, own_tables, target, index, tables, slots, strict)
    variable = {k for k in keys if k.endswith("/vocabulary/pending")}  # (P, 3), any P
    for k in keys:
        md = index[k]
        if type(md) is not d.TensorMD:
            raise ValueError(f"checkpoint entry {k!r} is not stored as a tensor; refusing it")
        if k in variable:
            if len(md.size) != 2 or md.size[1] != 3 or md.properties.dtype != torch.int64:
                raise ValueError(f"checkpoint entry {k!r} has shape {list(md.size)} and dtype "
                                 f"{md.properties.dtype}; a table's counted ids are int64 "
                                 f"[P, 3]; the checkpoint is corrupt")
            continue
        want = tuple(target[k].size())
        if tuple(md.size) != want:
            raise ValueError(f"checkpoint entry {k!r} has shape {list(md.size)} but the target's "
                             f"is {list(want)}" + _slot_hint(k, manifest, own_tables))
    # Read into fresh tensors shaped like the target's entries, then copy in at the end. Plain
    # tensors are views of the target (W = 1, V0 parameters); the sharded entries of a sharded
    # engine's state_dict() are copies already, which DCP fills with this process's rows.
    # A 16-bit table's rows stored wider are read at their stored dtype, then narrowed here
    # (``narrowed``: values beyond the table's range refused or saturated).
    narrowing = {k: target[k].dtype for k in keys
                 if k not in variable and type(target[k]) is torch.Tensor
                 and target[k].dtype in COMPACT
                 and wider(index[k].properties.dtype, target[k].dtype)}
    rescaled = _rescaled(keys, target, index)
    for k in rescaled:
        narrowing.pop(k, None)
    fresh = {k: torch.empty(tuple(index[k].size), dtype=torch.int64) if k in variable else
             torch.empty(tuple(index[k].size), dtype=index[k].properties.dtype)
             if k in narrowing or k in rescaled else
             torch.empty_like(target[k]) if type(target[k]) is torch.Tensor else target[k]
             for k in keys}
    for k, stored in rescaled.items():  # (an 8-bit table's stored scales, read to widen)
        if stored in SCALED and k.replace("/parameters", f"/{SCALES}") not in fresh:
            fresh[k.replace("/parameters", f"/{SCALES}")] = torch.empty(
                tuple(index[k.replace("/parameters", f"/{SCALES}")].size))
    if fresh:
        with _dcp_call(f"reading {ckpt}", comm.world_size):
            d.dcp.load(fresh, storage_reader=d.Reader(ckpt, checksums), planner=d.Planner(),
                       process_group=_group(comm), no_dist=comm.world_size == 1)
    for k, dtype in narrowing.items():
        fresh[k] = narrowed(fresh[k], dtype, k, f"{ckpt}", "the checkpoint", saturate)
    for k, stored in rescaled.items():
        _convert(fresh, k, stored, target, f"{ckpt}", saturate)
    if v0:  # into the layer's nn.Parameters, by table
        params = obj.embedding_tables
        with torch.no_grad():
            for k, value in fresh.items():
                params[k.removesuffix("/parameters")].copy_(value)
    else:
        engine.load_state_dict(fresh, strict=False)
    return manifest


def _rescaled(keys: list[str], target: Mapping[str, Any],
              index: Mapping[str, Any]) -> dict[str, torch.dtype]:
    """``{"<table>/parameters": stored dtype}`` of the tables to convert to or from 8-bit rows
    (their stored and target dtypes differ, one of them 8-bit); refused on a sharded engine."""
    out = {}
    for k in keys:
        if not k.endswith("/parameters") or not hasattr(index[k], "properties"):
            continue
        stored, want = index[k].properties.dtype, target[k].dtype
        if stored != want and (stored in SCALED or want in SCALED):
            if type(target[k]) is not torch.Tensor:
                raise ValueError(f"table {k.split('/')[0]!r}: its rows are "
                                 f"{str(stored).removeprefix('torch.')} in the checkpoint and "
                                 f"{str(want).removeprefix('torch.')} here; converting 8-bit "
                                 f"rows on load takes one process: load it into an engine of "
                                 f"the saved dtype, or on one process and save again")
            out[k] = stored
    return out


def _convert(fresh: dict[str, Any], key: str, stored: torch.dtype, target: Mapping[str, Any],
             source: str, saturate: bool) -> None:
    """Converts ``fresh``'s rows of ``key`` (read at their ``stored`` dtype) to the target's:
    8-bit rows widened with their stored scales; into an 8-bit table quantized to nearest, with
    new scales; into a 16-bit one narrowed as ``ec.load`` narrows (``narrowed``)."""
    scales_key = key.replace("/parameters", f"/{SCALES}")
    rows = fresh[key]  # (N, D)
    values = (widen(rows, fresh[scales_key]) if stored in SCALED
              else rows)  # (N, D) float
    want = target[key].dtype
    if want in SCALED:
        fresh[key], fresh[scales_key] = quantize(values.float(), want)
        return
    fresh.pop(scales_key, None)
    if want in COMPACT and wider(values.dtype, want):
        fresh[key] = narrowed(values, want, key, source, "the checkpoint", saturate)
    else:
        fresh[key] = values.to(want)


def _slot_hint(key: str, manifest: Mapping[str, Any], own_tables: Mapping[str, Any]) -> str:
    """For an optimizer slot of another shape: the two optimizers, and ``slots=False``."""
    table, _, slot = key.partition("/")
    if slot == "parameters" or slot.startswith("vocabulary/") or table not in own_tables:
        return ""
    saved = manifest.get("tables", {}).get(table, {})
    return (f": table {table!r} was saved with optimizer {saved.get('optimizer')} and the target "
            f"has {own_tables[table].get('optimizer')}, whose slot {slot!r} differs; load with "
            f"slots=False for the parameters only (the target's optimizer starts afresh)")


def _keys_to_load(manifest: Mapping[str, Any], own_tables: Mapping[str, Any],
                  target: Mapping[str, torch.Tensor], index: Mapping[str, Any],
                  tables: Sequence[str] | None, slots: bool, strict: bool) -> list[str]:
    """The state-dict keys to read, after checking the checkpoint against the target."""
    saved = manifest.get("tables", {})
    if isinstance(tables, str):
        raise TypeError(f"tables must be a list of table names, got the string {tables!r}")
    if tables is not None:
        names = list(dict.fromkeys(tables))
        unknown = [n for n in names if n not in saved]
        if unknown:
            raise ValueError(f"tables {unknown} are not in the checkpoint; it has "
                             f"{sorted(saved)}")
        absent = [n for n in names if n not in own_tables]
        if absent:
            raise ValueError(f"tables {absent} are not in the target; it has "
                             f"{sorted(own_tables)}")
    else:
        names = list(own_tables)
        absent = [n for n in names if n not in saved]
        if absent and strict:
            raise KeyError(f"tables {absent} of the target are not in the checkpoint (it has "
                           f"{sorted(saved)}); load with strict=False to skip them")
        names = [n for n in names if n in saved]
    complete = slots and set(names) == set(own_tables)  # the step needs every table and slot
    keys: list[str] = []
    for n in names:
        got, want = saved[n], own_tables[n]
        if (got["vocabulary_size"], got["dim"]) != (want["vocabulary_size"], want["dim"]):
            raise ValueError(f"table {n!r} has shape [{got['vocabulary_size']}, {got['dim']}] in "
                             f"the checkpoint but [{want['vocabulary_size']}, {want['dim']}] in "
                             f"the target; they must match")
        if (got.get("dynamic") is None) != (want.get("dynamic") is None):
            kinds = {True: "dynamic (raw ids)", False: "static (ids are rows)"}
            raise ValueError(f"table {n!r} is {kinds[got.get('dynamic') is not None]} in the "
                             f"checkpoint but {kinds[want.get('dynamic') is not None]} in the "
                             f"target; a table's rows cannot be read as the other kind")
        keys.append(f"{n}/parameters")
        if SCALES in want["slots"] and f"{n}/{SCALES}" in index:  # (part of the rows)
            keys.append(f"{n}/{SCALES}")
        if want.get("dynamic") is not None:  # the map, always (rows mean nothing without it)
            keys += [f"{n}/vocabulary/{k}" for k in ("ids", "last_use", "frequency", "step",
                                                     "seed")]
            if f"{n}/vocabulary/pending" in index:  # (older checkpoints: counting afresh)
                keys.append(f"{n}/vocabulary/pending")
        for s in (want["slots"] if slots else ()):
            if s == SCALES:  # (read with the rows above, or made from them: _convert)
                continue
            if f"{n}/{s}" in index:
                keys.append(f"{n}/{s}")
            elif strict:
                raise KeyError(f"slot {s!r} of table {n!r} is not in the checkpoint (saved with "
                               f"optimizer {got.get('optimizer')}); load with slots=False for "
                               f"parameters only, or strict=False to skip it")
            else:
                complete = False
    for k in keys:
        if k not in index:
            raise ValueError(f"checkpoint index lacks {k!r} although its manifest lists table "
                             f"{k.split('/')[0]!r}; the checkpoint is corrupt")
    if complete and "step" in target and "step" in index:
        keys.append("step")
    return keys
