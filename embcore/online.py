"""Online training: ``ec.publish`` what changed, ``ec.load_published`` to serve it live, and
``ec.load`` of a publish directory to resume (docs/semantics.md section 13).

The first ``publish`` of an engine to a directory writes a snapshot, each later one a delta: the
rows written since its previous publish there, found from the flags the step sets
(state/changes.py), read from wherever they are (memory, the cache, the slow tier), and written
as numbered, chained, checksummed entries (formats/published.py). With several processes every
process writes its own rows; process 0 commits the entry once all have written (every wait has
the engine's timeout). ``load_published`` returns a serving module that follows the directory
(serving/follow.py). ``load`` (checkpoint.py) hands a publish directory to ``resume`` here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import socket
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .base.comm import CollectiveError, everywhere, from_rank0, summed
from .base.nest import leaves_with_paths, unflatten_like
from .base.version import __version__
from .config.dtypes import SCALED, SCALES
from .config.spec import EmbeddingSpec
from .config.tables import FeatureConfig
from .engine import Embedding
from .formats import publish_writer as writer
from .formats import published as fmt
from .formats.files import agreed_token
from .layer import EmbeddingLayer, engine_of
from .numerics.rounding import COMPACT, narrowed, wider
from .serving.follow import PublishedModule
from .state.store import RowStore
from .state.vocab.vocabulary import PENDING, VOCAB

SNAPSHOTS_KEPT = 2       # retention: entries from the second newest snapshot on stay
COMPACT_RATIO = 1.0      # a publish whose deltas since the snapshot outgrow it is a snapshot
_VOCAB_KEYS = ("ids", "last_use", "frequency")


@dataclasses.dataclass
class _Publisher:
    """What an engine remembers of its publishes to one directory."""

    lock: writer.WriterLock | None  # process 0's
    seq: int                     # the entry its last publish made
    id: str
    chain: str | None            # the directory's chain identity (None: its next entry's id)
    slots: bool
    snapshot_bytes: int
    delta_bytes: int = 0
    # dynamic tables: (rows in use, the id each row holds) at that publish, per physical table
    # (rows freed since belong in the next delta, and the ids that left them are its evicted)
    used: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)


# per engine, per directory (its real path) it publishes to: its publish state
_PUBLISHERS: weakref.WeakKeyDictionary[Embedding, dict[str, _Publisher]] = \
    weakref.WeakKeyDictionary()


def _publishers(engine: Embedding) -> dict[str, _Publisher]:
    """The publish state ``engine`` keeps per directory (created empty)."""
    got = _PUBLISHERS.get(engine)
    if got is None:
        got = _PUBLISHERS[engine] = {}
    return got


def _engine(obj: Any, call: str) -> Embedding:
    engine = engine_of(obj, call)
    if isinstance(obj, EmbeddingLayer) and obj.tables_are_parameters:
        raise TypeError("publish needs the engine's optimizer: a layer built with "
                        "optimizer=None trains its tables as nn.Parameters, whose writes "
                        "the engine does not see (use ec.save)")
    return engine


def _all_ok(engine: Embedding, error: BaseException | None, what: str) -> None:
    """Raises on every process when any process failed (its error where it happened)."""
    ok = everywhere(engine.comm, error is None, engine.device)
    if error is not None:
        raise error
    if not ok:
        raise CollectiveError(f"embcore: {what} failed on another process; see its error")


def _serving_spec(engine: Embedding) -> dict[str, Any]:
    """The engine's features as a spec without optimizers or initializers: what serving needs,
    and always data (a callable learning rate or initializer does not stop a follower)."""
    template = engine.feature_config
    flat = leaves_with_paths(template, lambda x: isinstance(x, FeatureConfig))
    tables = {}
    for _, f in flat:
        if f.table not in tables:
            tables[f.table] = dataclasses.replace(f.table, initializer=None, optimizer=None,
                                                  name=engine.table_names()[f.table])
    leaves = [dataclasses.replace(f, table=tables[f.table]) for _, f in flat]
    served = unflatten_like(template, leaves, lambda x: isinstance(x, FeatureConfig))
    return EmbeddingSpec(served, None).to_dict()


SCALED_NAMES = {str(d).removeprefix("torch.") for d in SCALED}  # (as manifests name them)


# ------------------------------------------------------------------------------------ publish
def publish(directory: str | os.PathLike[str], obj: Embedding | EmbeddingLayer, *,
            slots: bool = False, snapshot: bool | None = None,
            keep_snapshots: int = SNAPSHOTS_KEPT,
            compact_ratio: float = COMPACT_RATIO) -> dict[str, Any]:
    """Publishes what changed in ``obj``'s tables since its last publish to ``directory``.

    The first publish of an engine to a directory writes a snapshot (every row); each later one
    a delta: the rows written since (a dynamic table's by row, with the raw id each holds; rows
    whose id was evicted, as free). Entries are atomic, numbered, chained and checksummed
    (formats/published.py); followers (``ec.load_published``) apply them in order. With several
    processes every process calls ``publish`` with the same arguments (a collective).

    Args:
        directory: the publish directory (created; one trainer at a time publishes to it).
        obj: an ``ec.Embedding`` or ``ec.EmbeddingLayer`` with an optimizer.
        slots: also carry the rows' optimizer slots, so that ``ec.load(directory, obj)``
            resumes training exactly. A change of ``slots`` makes the publish a snapshot.
        snapshot: True: a snapshot now (compaction: a reader then starts from it); None: when
            the deltas since the last snapshot outgrow ``compact_ratio`` times its bytes.
        keep_snapshots: after a snapshot, entries older than the ``keep_snapshots``-th newest
            snapshot are removed (a follower behind them reloads from a newer snapshot).
        compact_ratio: see ``snapshot``.

    Returns:
        ``{"seq", "kind" ("snapshot" | "delta"), "step", "rows": {table: rows carried},
        "bytes": bytes of tensors written, "seconds"}``.

    Raises:
        TypeError: ``obj`` is not an engine or layer with an optimizer.
        RuntimeError: another trainer publishes to ``directory``.
        FileExistsError: ``directory`` exists and is neither empty nor a publish directory.
        PublishError (a ValueError): the directory changed under this trainer (an entry it did
            not write, or its last entry gone); its writer lock is not a regular file (a
            symbolic link: never followed).
        OSError: a write failed (a full disk: ``ENOSPC``, torch's own error chained): nothing
            is published, the changes are kept for the next publish, the lock is let go.

    Example:
        >>> import tempfile, torch, embcore as ec
        >>> t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
        >>> emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
        >>> d = tempfile.mkdtemp()
        >>> ec.publish(d, emb)["kind"]
        'snapshot'
        >>> emb.enqueue({"f": torch.tensor([1, 2])}); act = emb.dequeue()["f"]
        >>> emb.apply_gradients({"f": torch.ones_like(act)})
        >>> info = ec.publish(d, emb); info["kind"], info["rows"]
        ('delta', {'t': 2})
        >>> served = ec.load_published(d)       # a ServingModule; served.refresh() follows
        >>> served.version
        1
    """
    engine = _engine(obj, "ec.publish")
    _check_publish_args(slots, snapshot, keep_snapshots, compact_ratio)
    start = time.perf_counter()
    directory = Path(os.fspath(directory))
    with engine.quiescent() as store:
        pub, lock = _open(engine, directory)
        kind = "snapshot" if (pub is None or snapshot or bool(slots) != pub.slots or (
            snapshot is None and pub.delta_bytes > compact_ratio * pub.snapshot_bytes)) \
            else "delta"
        comm, tmp, key = engine.comm, None, _key(directory)
        changes, taken = None, None
        published = False
        try:
            changes = store.track()
            taken = changes.take(key)  # (rows per physical table; given back if this fails)
            seq = (pub.seq + 1) if pub is not None else _next_seq(engine, directory)
            tmp = writer.temporary(directory, seq, agreed_token(comm, engine.device))
            used: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            rows, nbytes, files = _write_entry(engine, store, directory, tmp, kind, pub,
                                               bool(slots), used, taken)
            entry_id = f"{from_rank0(comm, [secrets.randbits(63)], engine.device)[0]:016x}"
            chain_id = _commit_entry(engine, directory, tmp, pub, seq, kind, entry_id,
                                     bool(slots), rows, nbytes, files)
            published = True
        finally:
            if not published:  # nothing published: the rows go out with the next publish
                if changes is not None and taken is not None:
                    changes.give_back(key, taken)
                if lock is not None:  # (taken by this call)
                    lock.release()
                if tmp is not None and comm.rank == 0:  # (gone already once committed)
                    shutil.rmtree(tmp, ignore_errors=True)
        _remember(engine, directory, pub, lock, seq, entry_id, chain_id, kind, bool(slots),
                  used, nbytes, keep_snapshots)
    return {"seq": seq, "kind": kind, "step": engine.step, "rows": rows, "bytes": nbytes,
            "seconds": time.perf_counter() - start}


def _check_publish_args(slots: bool, snapshot: bool | None, keep_snapshots: int,
                        compact_ratio: float) -> None:
    """``publish``'s options: a TypeError or ValueError naming the one that is wrong."""
    for arg, value, kinds in (("slots", slots, (bool,)), ("snapshot", snapshot, (bool, type(None))),
                              ("keep_snapshots", keep_snapshots, (int,)),
                              ("compact_ratio", compact_ratio, (int, float))):
        if not isinstance(value, kinds) or (arg in ("keep_snapshots", "compact_ratio")
                                            and isinstance(value, bool)):
            raise TypeError(f"{arg} must be {' or '.join(k.__name__ for k in kinds)}, got "
                            f"{type(value).__name__} {value!r}")
    if keep_snapshots < 1:
        raise ValueError(f"keep_snapshots must be an int >= 1, got {keep_snapshots!r}")
    if not compact_ratio > 0 or compact_ratio == float("inf"):
        raise ValueError(f"compact_ratio must be a finite number > 0, got {compact_ratio!r}")


def _write_entry(engine: Embedding, store: Any, directory: Path, tmp: Path, kind: str,
                 pub: _Publisher | None, slots: bool,
                 used: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 taken: Any) -> tuple[dict[str, int], int, dict[str, Any]]:
    """Every process writes its parts of the entry into ``tmp`` (process 0 made it); returns
    the rows carried per table and the bytes, summed over the processes, and this process's
    files' checksums and sizes (``{"files", "sizes"}``; with several processes also beside
    them, for process 0)."""
    comm = engine.comm
    error: BaseException | None = None
    if comm.rank == 0:
        try:
            writer.remove_stale(directory)
            tmp.mkdir()
        except OSError as e:
            error = e
    _all_ok(engine, error, f"creating {tmp}")
    written: dict[str, dict[str, int]] = {}
    sizes: dict[str, int] = {}
    rows = dict.fromkeys(engine.table_names().values(), 0)
    try:
        chunks = _chunks_to_write(store, kind, pub, slots, rows, used, taken)
        for i, part in enumerate(writer.parts(chunks)):
            name = writer.part_name(comm.rank, i)
            written[name] = writer.write_part(tmp / name, part)
            sizes[name] = os.path.getsize(tmp / name)
        if comm.world_size > 1:  # process 0 gathers the files' checksums from these
            (tmp / f"r{comm.rank:05d}.json").write_text(
                json.dumps({"files": written, "sizes": sizes}), encoding="utf-8")
    except BaseException as e:
        error = e
    _all_ok(engine, error, f"writing {tmp}")
    # every process's files and counts, then process 0 commits
    names = sorted(rows)
    totals = summed(comm, [rows[n] for n in names] + [sum(sizes.values())], engine.device)
    return dict(zip(names, totals[:-1])), totals[-1], {"files": written, "sizes": sizes}


def _commit_entry(engine: Embedding, directory: Path, tmp: Path, pub: _Publisher | None,
                  seq: int, kind: str, entry_id: str, slots: bool, rows: dict[str, int],
                  nbytes: int, mine: dict[str, Any]) -> str | None:
    """Process 0 gathers every process's files, writes the entry's manifest (chained to the one
    before it) and renames ``tmp`` into place; every process learns whether it did. Returns
    the chain's identity (process 0's: the one its manifests carry)."""
    comm = engine.comm
    error: BaseException | None = None
    chain_id = pub.chain if pub is not None else None
    if comm.rank == 0:
        try:
            files: dict[str, dict[str, int]] = {}
            all_sizes: dict[str, int] = {}
            for r in range(comm.world_size):
                side = tmp / f"r{r:05d}.json"
                got: dict[str, Any] = mine if r == 0 \
                    else json.loads(side.read_text(encoding="utf-8"))
                files.update(got["files"])
                all_sizes.update(got["sizes"])
                if comm.world_size > 1:
                    side.unlink()
            if pub is None:  # a trainer's first entry here continues its chain
                previous, chain_id = fmt.continuation(directory)
            else:
                previous = {"seq": pub.seq, "id": pub.id}
                if chain_id is None:  # (resumed from entries written before chains)
                    chain_id = fmt.identity(fmt.entries(directory))[0]
            chain_id = chain_id or entry_id  # (the first entry: the chain's identity)
            manifest = {
                "format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION,
                "seq": seq, "kind": kind, "id": entry_id, "previous": previous,
                "chain": chain_id, "step": engine.step, "slots": slots,
                "serving_spec": _serving_spec(engine), "engine": engine.manifest(),
                "world_size": comm.world_size, "files": files, "sizes": all_sizes,
                "rows": rows, "bytes": nbytes, "time": time.time(),
                "writer": {"host": socket.gethostname(), "pid": os.getpid(),
                           "embcore_version": __version__}}
            writer.commit(tmp, directory, manifest)
        except BaseException as e:
            error = e
    _all_ok(engine, error, f"committing entry {seq} of {directory}")
    return chain_id


def _remember(engine: Embedding, directory: Path, pub: _Publisher | None,
              lock: writer.WriterLock | None, seq: int, entry_id: str, chain_id: str | None,
              kind: str, slots: bool, used: dict[int, tuple[torch.Tensor, torch.Tensor]],
              nbytes: int, keep_snapshots: int) -> None:
    """The engine's publish state for ``directory`` after entry ``seq`` (the next publish's
    predecessor and compaction figures); after a snapshot, process 0 removes the entries older
    than the ``keep_snapshots``-th newest snapshot."""
    if pub is None:
        pub = _Publisher(lock, seq, entry_id, None, slots, 0)
        _publishers(engine)[_key(directory)] = pub
    pub.lock = pub.lock or lock
    pub.seq, pub.id, pub.slots = seq, entry_id, slots
    pub.chain = chain_id  # (process 0 writes the manifests: its value is the one used)
    pub.used.update(used)
    if kind == "snapshot":
        pub.snapshot_bytes, pub.delta_bytes = nbytes, 0
        if engine.comm.rank == 0:
            writer.retain(directory, keep_snapshots)
    else:
        pub.delta_bytes += nbytes


def _key(directory: Path) -> str:
    return os.path.realpath(directory)


def _open(engine: Embedding, directory: Path
          ) -> tuple[_Publisher | None, writer.WriterLock | None]:
    """The engine's publish state for ``directory`` (None: its first publish there), checked
    against the directory, and the directory's writer lock when process 0 takes it now (its
    first publish there, or its first since ``ec.load`` of the directory)."""
    pub = _publishers(engine).get(_key(directory))
    error: BaseException | None = None
    lock = None
    if engine.comm.rank == 0:
        try:
            if pub is not None:
                found = fmt.entries(directory)
                if not found or found[-1].seq != pub.seq:
                    raise fmt.PublishError(
                        f"{directory} changed under this trainer: its newest entry is "
                        f"{found[-1].seq if found else 'gone'}, not the {pub.seq} it "
                        f"published or loaded last")
            else:
                if directory.exists() and not directory.is_dir():
                    raise FileExistsError(f"{directory} exists and is not a directory")
                if directory.is_dir() and not fmt.is_publish_dir(directory) and any(
                        not n.startswith(".") for n in os.listdir(directory)):
                    raise FileExistsError(f"{directory} exists and is neither empty nor a "
                                          f"publish directory; refusing to publish into it")
                directory.mkdir(parents=True, exist_ok=True)
            if pub is None or pub.lock is None:
                lock = writer.WriterLock(directory)
        except BaseException as e:
            error = e
    _all_ok(engine, error, f"opening {directory}")
    return pub, lock


def _next_seq(engine: Embedding, directory: Path) -> int:
    found = fmt.entries(directory) if engine.comm.rank == 0 else []
    return from_rank0(engine.comm, [found[-1].seq + 1 if found else 0], engine.device)[0]


def _chunks_to_write(store: RowStore, kind: str, pub: _Publisher | None, slots: bool,
                     counts: dict[str, int],
                     used: dict[int, tuple[torch.Tensor, torch.Tensor]],
                     taken: list[torch.Tensor]) -> Iterator[Iterator[dict[str, torch.Tensor]]]:
    """Per logical table this process writes, its chunks of rows (``_chunks``); counts the rows
    in ``counts`` and keeps each dynamic table's rows in use and their ids in ``used``."""
    plan, rank = store.plan, store.comm.rank
    changed: dict[int, torch.Tensor] = {}
    for place in plan.tables:
        if place.placement.held_everywhere and rank != 0:
            continue
        p = place.physical
        n = place.row_counts[rank]
        if n == 0:
            continue
        in_use = store.in_use(p) if p not in used else None  # (a raw-id table's)
        if in_use is not None:  # (N_p,) rows in use and the ids they hold
            used[p] = in_use
        mapped = p in used
        evicted = None
        if kind == "snapshot":
            local = torch.arange(n)
        else:
            assert pub is not None
            if p not in changed:
                rows = taken[p]  # (k,) shard rows written since, ascending
                if mapped and p in pub.used:  # and rows freed since
                    freed = (pub.used[p][0] & ~used[p][0]).nonzero().squeeze(1)
                    rows = torch.unique(torch.cat([rows, freed]))
                changed[p] = rows
            start = place.local_offsets[rank]
            rows = changed[p]
            local = rows[(rows >= start) & (rows < start + n)] - start
            if mapped and p in pub.used:
                evicted = _evicted(store.member(place.name), pub.used[p], local + start)
        counts[place.name] += local.numel()
        if local.numel() or (slots and _counts(store, place)):  # (counted ids: every time)
            yield _chunks(store, place, local, slots, mapped, evicted)


def _counts(store: RowStore, place: Any) -> bool:
    """Whether a table counts ids before admitting them (``admit_after > 1``): with slots its
    counted ids go in every entry (``T/vocabulary/pending``), whole."""
    return store.counts_ids(place.name)


def _evicted(dyn: Any, before: tuple[torch.Tensor, torch.Tensor],
             rows: torch.Tensor) -> torch.Tensor:
    """(e,) ascending: the ids that shard rows ``rows`` held at the last publish (``before``:
    rows in use then and their ids) that are resident nowhere in this shard now."""
    was_used, was_id = before
    old = torch.unique(was_id[rows][was_used[rows]])  # (k,) ascending, distinct
    if old.numel() == 0:
        return old
    now, _, _ = dyn.resolve(old, training=False)  # (k,) rows; the zero row: not resident
    return old[now == dyn.zero_row]


def _chunks(store: RowStore, place: Any, local: torch.Tensor, slots: bool, dynamic: bool,
            evicted: torch.Tensor | None = None) -> Iterator[dict[str, torch.Tensor]]:
    rank = store.comm.rank
    phys = store.plan.physical[place.physical]
    c0, c1 = place.placement.columns(rank)
    keys = ["parameters"] + ([s.name for s in phys.optimizer.slots]
                             if slots and phys.optimizer is not None else [])
    if phys.dtype in SCALED and SCALES not in keys:  # 8-bit rows: codes with their scales
        keys.append(SCALES)
    width = 8 + (c1 - c0) * 4 * len(keys)
    step = max(1, writer.PART_BYTES // width)
    held = place.placement.held_rows(rank)
    for i in range(0, max(local.numel(), 1), step):  # (a dynamic table: one chunk at least)
        part = local[i:i + step]
        name = place.name
        chunk = {f"{name}/rows": held[part].to(torch.int64)}
        if (c0, c1) != (0, place.dim):
            chunk[f"{name}/columns"] = torch.tensor([c0, c1], dtype=torch.int64)
        for k in keys:
            chunk[f"{name}/{k}"] = store.read(name, k, part)
        if dynamic:
            dyn = store.member(place.name)
            for k in _VOCAB_KEYS:
                chunk[f"{name}/{VOCAB}{k}"] = store.read(name, VOCAB + k, part)
            for k in ("step", "seed"):
                chunk[f"{name}/{VOCAB}{k}"] = dyn.scalar(k)
            if evicted is not None and i == 0:  # (the ids evicted since the last publish)
                chunk[f"{name}/{VOCAB}evicted"] = evicted
            if slots and i == 0 and _counts(store, place):  # its counted ids, whole
                chunk[f"{name}/{VOCAB}{PENDING}"] = dyn.pending()
        yield chunk


# ------------------------------------------------------------------------------------ read
def load_published(directory: str | os.PathLike[str], *, quantize: Any = None
                   ) -> PublishedModule:
    """A serving module (``ServingModule``, as ``for_serving`` makes) of the newest state in a
    publish directory, which follows it: ``refresh()`` applies every newer entry in order and
    returns how many; ``version`` is the entry it reflects.

    Args:
        directory: a directory ``ec.publish`` writes to.
        quantize: as ``for_serving``'s (None, ``"int8"``, ``"fp16"`` or per table); a refresh
            re-quantizes the rows it changes.

    Raises:
        FileNotFoundError: nothing published there yet.
        PublishError (a ValueError): a corrupt or missing file, a file that is not a regular
            file of its stated size (a link, a FIFO: never followed, never waited on), a broken
            chain, an entry of another chain (docs/semantics.md section 13).
    """
    return PublishedModule(Path(os.fspath(directory)), quantize=quantize)


def resume(directory: Path, obj: Embedding | EmbeddingLayer, *, slots: bool = True,
           strict: bool = True, saturate: bool = False) -> dict[str, Any]:
    """``ec.load`` of a publish directory: the newest published state into ``obj`` (its
    tables, slots, maps and step), checked whole before anything is written; later publishes
    of ``obj`` to ``directory`` continue its chain with deltas. Tables and slots follow a
    checkpoint's rules (docs/semantics.md section 7): ``strict=False`` skips a table or slot of
    ``obj`` the directory lacks (another optimizer), and the step is restored only when every
    table is loaded with all its slots. Read again from the newest snapshot when the trainer's
    retention removes an entry meanwhile. A 16-bit table of ``obj`` whose rows were published
    wider follows a checkpoint's narrowing rule (``saturate``; docs/semantics.md section 14).

    Raises:
        ValueError: with ``strict`` and ``slots``, the entries were published without slots;
            tables that do not match ``obj``'s; PublishError for a damaged directory or an
            entry of another chain.
        KeyError: with ``strict``, a table or slot of ``obj`` the directory lacks.
    """
    engine = _engine(obj, "ec.load")
    narrow = {n: getattr(torch, t["dtype"]) for n, t in engine.manifest()["tables"].items()
              if getattr(torch, t["dtype"]) in COMPACT}
    with engine.quiescent() as store:
        shapes = store.state_shapes()
    own = engine.manifest()["tables"]

    def read(run: list[fmt.Entry], manifests: list[dict[str, Any]]
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        last = manifests[-1]
        slotted = all(m.get("slots") for m in manifests)
        if slots and strict and not slotted:
            raise ValueError(f"{directory} was published with slots=False (entries "
                             f"{[m['seq'] for m in manifests if not m.get('slots')]}): it holds "
                             f"no optimizer slots to resume training from; load it with "
                             f"slots=False for the parameters only")
        saved = last["engine"].get("tables", {})
        names = [n for n in own if n in saved]
        missing = [n for n in own if n not in saved]
        if missing and strict:
            raise KeyError(f"tables {missing} are not in {directory} (it has {sorted(saved)}); "
                           f"load with strict=False to skip them")
        for n in names:
            got, want = saved[n], own[n]
            if (got["vocabulary_size"], got["dim"]) != (want["vocabulary_size"], want["dim"]) \
                    or (got.get("dynamic") is None) != (want.get("dynamic") is None):
                raise ValueError(f"table {n!r} is [{got['vocabulary_size']}, {got['dim']}]"
                                 f"{' dynamic' if got.get('dynamic') else ''} in {directory} "
                                 f"but [{want['vocabulary_size']}, {want['dim']}]"
                                 f"{' dynamic' if want.get('dynamic') else ''} in the target")
            if got.get("dtype") != want["dtype"] and SCALED_NAMES & {got.get("dtype"),
                                                                     want["dtype"]}:
                raise ValueError(f"table {n!r} has {got.get('dtype')} rows in {directory} but "
                                 f"{want['dtype']} rows in the target; 8-bit rows resume into "
                                 f"a table of the same dtype only (ec.save and ec.load convert "
                                 f"them)")
        complete = slots and not missing  # (the step needs every table with all its slots)
        keys: dict[str, tuple[int, ...]] = {}
        for k, shape in shapes.items():
            n, _, what = k.partition("/")
            if n not in names:
                continue
            if what == "parameters" or what.startswith(VOCAB) or (
                    what == SCALES and own[n]["dtype"] in SCALED_NAMES):  # (part of the rows)
                keys[k] = shape
            elif not slots:
                continue
            elif slotted and what in (saved[n].get("slots") or ()):
                keys[k] = shape
            elif strict:
                raise KeyError(f"slot {what!r} of table {n!r} is not in {directory} (published "
                               f"with optimizer {saved[n].get('optimizer')}); load with "
                               f"slots=False for parameters only, or strict=False to skip it")
            else:
                complete = False
        if slots and slotted:  # the admission counts, which each entry with slots carries whole
            keys.update({f"{n}/{VOCAB}{PENDING}": fmt.VARIABLE for n in names
                         if own[n].get("dynamic") is not None})
        state = fmt.replay(run, manifests, keys)
        for n, dtype in narrow.items():  # rows published wider than this table holds them
            k = f"{n}/parameters"
            got = state.get(k)
            if type(got) is torch.Tensor and wider(got.dtype, dtype):
                state[k] = narrowed(got, dtype, k, f"{directory}", "the published entries",
                                    saturate)
        if complete:
            state["step"] = torch.tensor(last["step"], dtype=torch.int64)
        return last, state

    last, state = fmt.newest(directory, read)
    engine.load_state_dict(state, strict=False)
    with engine.quiescent() as store:  # later publishes continue this chain
        store.track().take(_key(directory))  # (from now on: what the load wrote is in it)
        old = _publishers(engine).get(_key(directory))
        used = {p: u for p in range(len(store)) if (u := store.in_use(p)) is not None}
        _publishers(engine)[_key(directory)] = _Publisher(
            old.lock if old is not None else None, last["seq"], last["id"], last.get("chain"),
            bool(last.get("slots")), 0, used=used)
    return {**last["engine"], "step": last["step"], "seq": last["seq"]}
