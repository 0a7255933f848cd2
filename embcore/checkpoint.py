"""Checkpoints: ``ec.save(path, obj)`` / ``ec.load(path, obj)`` for an Embedding or EmbeddingLayer.

Format. A checkpoint is a directory written by ``torch.distributed.checkpoint`` (DCP):

    <path>/
      .metadata        DCP's index: every key's shape, dtype and where its bytes lie (a pickle)
      __0_0.distcp     the tensors' bytes (one file per writing process)
      manifest.json    plain JSON: the object's ``manifest()`` (configs, plan, step), the user's
                       ``extra`` metadata and the format version

holding the object's ``state_dict()`` under TF's names: ``<table>/parameters``,
``<table>/<slot>`` (accumulators, momenta, velocities, linears) and ``step``; a dynamic table
(raw ids) adds its map, ``<table>/vocabulary/{ids,last_use,frequency}`` laid out by row like its
parameters, and ``<table>/vocabulary/{step,seed}`` (vocabulary.py). Entries are whole
logical tables, so a checkpoint does not depend on how the tables were stacked or placed: loading
fills tensors shaped as the *target's* state dict, which is what lets DCP restore a checkpoint
written by W processes into W' processes with another layout.

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
``manifest.json`` is plain JSON.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import secrets
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from .base.comm import CollectiveError
from .base.compat import (
    DCP_INDEX,
    DCP_INDEX_PRIVATE_GLOBALS,
    DCP_NO_PROCESS_GROUP_WARNING,
    PICKLED_PATH_MODULES,
    dcp_index_name,
)
from .engine import Embedding
from .layer import EmbeddingLayer
from .online import resume
from .state.published import is_publish_dir

FORMAT = "embcore.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_METADATA = DCP_INDEX  # DCP's index file (".metadata")

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


class RestrictedMetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` index, resolving only ``ALLOWED_METADATA_GLOBALS`` and torch
    dtypes; anything else (``os.system``, ``builtins.eval``, ...) is refused before it is looked
    up, so a crafted index cannot run code.

    Raises:
        pickle.UnpicklingError: naming the refused ``module.name``.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not a class a "
            f"torch.distributed.checkpoint index holds; refusing to load it (the file may have "
            f"been tampered with)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("checkpoint metadata holds a persistent id; refusing it")


@functools.cache
def _dcp() -> SimpleNamespace:
    """torch.distributed.checkpoint and our reader / planner, imported on first use.

    (Importing DCP takes about a second, more than the rest of embcore; ``import embcore`` should
    not pay it.)
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    class SafeReader(FileSystemReader):
        """FileSystemReader whose index is read by the restricted unpickler and checked."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")
            path = Path(self.path) / dcp_index_name(rank)
            with open(path, "rb") as f:
                md = RestrictedMetadataUnpickler(f).load()
            if not isinstance(md, Metadata):
                raise pickle.UnpicklingError(f"{path} holds a {type(md).__name__}, not a "
                                             f"torch.distributed.checkpoint Metadata")
            for info in (md.storage_data or {}).values():
                rel = str(getattr(info, "relative_path", ""))
                if not rel or rel != os.path.basename(rel) or rel in (".", ".."):
                    raise ValueError(f"checkpoint index points at {rel!r}, outside its "
                                     f"directory; refusing to read it")
                if getattr(info, "transform_descriptors", None):
                    raise ValueError(f"checkpoint index asks for stream transforms "
                                     f"{info.transform_descriptors}; embcore writes none")
            if getattr(md, "storage_meta", None) is not None:  # as DCP's reader does (compat.py)
                md.storage_meta.load_id = self.load_id
            return md

    class TensorOnlyLoadPlanner(DefaultLoadPlanner):
        """DCP's planner, minus ``load_bytes`` (which would ``torch.load(weights_only=False)``)."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise ValueError(f"checkpoint entry {read_item.dest_index.fqn!r} is stored as "
                             f"pickled bytes, not a tensor; refusing to unpickle it")

    return SimpleNamespace(dcp=dcp, Writer=FileSystemWriter, Reader=SafeReader,
                           Planner=TensorOnlyLoadPlanner, TensorMD=TensorStorageMetadata,
                           CheckpointException=CheckpointException)


# --------------------------------------------------------------------------------- the object
def _engine_and_state(obj: Any) -> tuple[Embedding, dict[str, torch.Tensor], bool]:
    """(engine, the state dict to save / fill, whether obj is a V0 layer)."""
    if isinstance(obj, EmbeddingLayer):
        if obj.tables_are_parameters:  # the layer's nn.Parameters; the engine's are unused
            return obj.engine, {k: v.detach() for k, v in obj.state_dict().items()}, True
        return obj.engine, obj.engine.state_dict(), False
    if isinstance(obj, Embedding):
        return obj, obj.state_dict(), False
    raise TypeError(f"obj must be an ec.Embedding or ec.EmbeddingLayer, got "
                    f"{type(obj).__name__}")


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
        except _dcp().CheckpointException as e:
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
    mine = torch.tensor([os.getpid(), secrets.randbits(62)], dtype=torch.int64,
                        device=engine.device)
    pid, rand = (int(x) for x in engine.comm.all_gather(mine)[0].cpu())
    return f"{pid}-{rand:016x}"


def _all_ok(engine: Embedding, ok: bool) -> bool:
    """Whether ``ok`` holds on every process (a collective when sharded)."""
    if engine.comm.world_size == 1:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int64, device=engine.device)
    return all(bool(f.item()) for f in engine.comm.all_gather(flag))


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
    engine, state, v0 = _engine_and_state(obj)  # a collective when sharded
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
        text = json.dumps(manifest, indent=1, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must hold only JSON values (dict, list, str, int, finite float, "
                        f"bool, None): {e}") from e

    # Every process checks the (shared) file system alike, so all raise or none does.
    path = Path(os.fspath(path))
    if path.exists() and not _is_checkpoint(path) and not (path.is_dir() and
                                                           not any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an embcore checkpoint; refusing to "
                              f"replace it (choose another path or remove it)")
    tmp = path.with_name(f"{path.name}.tmp-{_agreed_token(engine)}")
    lead = comm.rank == 0  # creates the directory, writes the manifest and swaps it in
    error: BaseException | None = None
    if lead:
        _remove_stale_temporaries(path)
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            error = e
    if not _all_ok(engine, error is None):  # every process raises, none waits for the others
        raise error or RuntimeError(f"rank 0 could not create {tmp}; see its error")
    try:
        d = _dcp()
        # each process writes its shards; rank 0 the index
        with _dcp_call(f"writing {tmp}", comm.world_size):
            d.dcp.save(state, storage_writer=d.Writer(tmp, sync_files=True),
                       process_group=_group(comm), no_dist=comm.world_size == 1)
    except BaseException:
        if lead:
            _remove_tree(tmp, missing_ok=True)
        raise
    if lead:
        try:
            with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            _swap_in(tmp, path)
        except BaseException as e:  # re-raised below, after telling the other processes
            _remove_tree(tmp, missing_ok=True)
            error = e
    if not _all_ok(engine, error is None):
        raise error or RuntimeError(f"rank 0 failed to complete the checkpoint {path}; see its "
                                    f"error")


def _remove_stale_temporaries(path: Path) -> None:
    """Removes ``<path>.tmp-<pid>-<token>`` directories of writers that died on this machine (their
    pid no longer runs): what a killed save leaves. A live writer's directory is kept."""
    for tmp in path.parent.glob(f"{path.name}.tmp-*-*") if path.parent.is_dir() else ():
        pid = tmp.name[len(path.name) + len(".tmp-"):].split("-", 1)[0]
        if not pid.isdigit() or not tmp.is_dir():
            continue
        try:
            os.kill(int(pid), 0)  # signal 0: does the process exist?
        except ProcessLookupError:
            _remove_tree(tmp, missing_ok=True)
        except (PermissionError, OSError):
            continue  # it exists (another user's) or cannot be told: keep it


def _swap_in(tmp: Path, path: Path) -> None:
    """Makes the complete directory ``tmp`` the checkpoint ``path``, keeping the previous one
    loadable at every instant (as ``path``, or as ``path.old`` between the two renames)."""
    old = _old(path)
    if path.exists():
        # path only ever appears complete, so a leftover .old (a writer killed while removing
        # it) is stale; when path is absent, .old is the latest checkpoint and stays until the
        # new one is in place.
        _remove_tree(old, missing_ok=True)
        _replace(path, old)
    _replace(tmp, path)
    _fsync_dir(path.parent)
    _remove_tree(old, missing_ok=True)


# File-system steps as module functions, so tests can interrupt a save between any two of them.
def _replace(src: Path, dst: Path) -> None:
    os.replace(src, dst)


def _remove_tree(p: Path, missing_ok: bool = False) -> None:
    if missing_ok and not p.exists():
        return
    shutil.rmtree(p)


def _fsync_dir(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # platforms that cannot open directories (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _is_checkpoint(p: Path) -> bool:
    return (p / MANIFEST).is_file() and (p / _METADATA).is_file()


# --------------------------------------------------------------------------------- load
def load(path: str | os.PathLike[str], obj: Embedding | EmbeddingLayer, *,
         tables: Sequence[str] | None = None, slots: bool = True,
         strict: bool = True) -> dict[str, Any]:
    """Restores tables (and optimizer slots and step) from a checkpoint into ``obj``, in place.

    The checkpoint may come from another object with the same tables (another stacking, device,
    optimizer or layer kind). ``obj`` is changed only once everything is read and checked:
    any error leaves it untouched. Tensors are copied onto ``obj``'s device and dtype. When the
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

    Returns:
        The checkpoint's manifest: ``{"format", "format_version", "embcore_version", "step",
        "tables": {name: {vocabulary_size, dim, combiner, dtype, optimizer, slots}}, "features",
        "plan", "world_size", "keys", "extra", ...}``.

    Raises:
        FileNotFoundError: ``path`` (and ``<path>.old``) is not a checkpoint.
        ValueError: ``tables`` names a table the checkpoint or ``obj`` lacks; a table's
            vocabulary_size / dim differs between checkpoint and ``obj``; a corrupt or
            truncated checkpoint.
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
        return resume(Path(os.fspath(path)), obj, slots=slots, strict=strict)
    engine, target, v0 = _engine_and_state(obj)  # a collective when sharded
    comm = engine.comm
    ckpt = _resolve(Path(os.fspath(path)))
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{ckpt / MANIFEST} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{ckpt} is not an embcore checkpoint (manifest.json has no "
                         f"format {FORMAT!r})")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{ckpt} has format version {manifest['format_version']}; this embcore "
                         f"({manifest.get('embcore_version')}) reads up to {FORMAT_VERSION}")
    d = _dcp()
    index = d.Reader(ckpt).read_metadata().state_dict_metadata  # {key: storage metadata}

    keys = _keys_to_load(manifest, engine.manifest()["tables"], target, index,
                         tables, slots, strict)
    for k in keys:
        md, want = index[k], tuple(target[k].size())
        if type(md) is not d.TensorMD:
            raise ValueError(f"checkpoint entry {k!r} is not stored as a tensor; refusing it")
        if tuple(md.size) != want:
            raise ValueError(f"checkpoint entry {k!r} has shape {list(md.size)} but the target's "
                             f"is {list(want)}")
    # Read into fresh tensors shaped like the target's entries, then copy in at the end. Plain
    # tensors are views of the target (W = 1, V0 parameters); the sharded entries of a sharded
    # engine's state_dict() are copies already, which DCP fills with this process's rows.
    fresh = {k: torch.empty_like(target[k]) if type(target[k]) is torch.Tensor else target[k]
             for k in keys}
    if fresh:
        with _dcp_call(f"reading {ckpt}", comm.world_size):
            d.dcp.load(fresh, storage_reader=d.Reader(ckpt), planner=d.Planner(),
                       process_group=_group(comm), no_dist=comm.world_size == 1)
    if v0:
        obj.load_state_dict(fresh, strict=False)
    else:
        engine.load_state_dict(fresh, strict=False)
    return manifest


def _resolve(path: Path) -> Path:
    """The directory to read: ``path``, or ``path.old`` left by a save killed mid-swap."""
    if path.exists():
        if not _is_checkpoint(path):
            raise FileNotFoundError(f"{path} is not an embcore checkpoint: it lacks "
                                    f"{MANIFEST} or {_METADATA}")
        return path
    if _is_checkpoint(_old(path)):
        return _old(path)
    raise FileNotFoundError(f"no checkpoint at {path} (nor a previous one at {_old(path)})")


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
        if want.get("dynamic") is not None:  # the map, always (rows mean nothing without it)
            keys += [f"{n}/vocabulary/{k}" for k in ("ids", "last_use", "frequency", "step",
                                                     "seed")]
        for s in (want["slots"] if slots else ()):
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

