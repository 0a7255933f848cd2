"""A serving module that follows a publish directory (``ec.load_published``).

``PublishedModule`` is a ``ServingModule`` (serve.py) built from the newest state of a directory
``ec.publish`` writes (formats/published.py): its newest snapshot and the deltas after it.
``refresh()`` applies the newer entries in order, each as one unit:

1. read and check the entry (every checksum) and compute what it changes, away from lookups:
   each changed table's new rows (quantized again for a quantized table), and a dynamic table's
   new map (the raw id each row holds, then the sorted ids the lookups search);
2. make it what lookups see, under the module's write lock (lookups hold the read lock): a
   dynamic table's map is written in place, and each changed table's new rows become an
   **overlay** that lookups read in place of the table's rows;
3. write the changed rows into the tables in place, without the lock (lookups read those rows
   from the overlay meanwhile, so a row being written is never read), then drop the overlays
   under the lock.

A lookup therefore sees the model before or after the entry, never a mix of the two and never
a torn row, and waits at most for the brief locked steps (a dynamic table's map: 16 bytes per
row of its capacity), never for the read, the checks or the rows' writes.

Buffers are written in place and keep their shapes (a dynamic table's map is padded to its
capacity, ``serve.padded_map``), so a program made from the module by ``torch.export`` reads
the refreshed values too; such a program does not take the lock (docs/semantics.md section 13).
Any number of processes may follow one directory; they only read it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..base.nest import leaves_with_paths
from ..config.dtypes import SCALED, SCALES
from ..config.spec import EmbeddingSpec
from ..config.tables import FeatureConfig, resolve_table_names
from ..formats import published as fmt
from ..numerics.rounding import widen
from ..state.vocab.vocabulary import VOCAB
from .quantize import quantize_table
from .serve import ServingModule, padded_map


class ReadWriteLock:
    """Many readers or one writer; a waiting writer goes before new readers. A thread holding
    the read lock may take it again (nested lookups), even while a writer waits."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._depth = threading.local()

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            with self._cond:
                while self._writing or self._writers_waiting:
                    self._cond.wait()
                self._readers += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            if depth == 0:
                with self._cond:
                    self._readers -= 1
                    if not self._readers:
                        self._cond.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


# The locks live beside the modules, not in them: a module stays copyable and picklable.
_LOCKS: dict[int, tuple[ReadWriteLock, threading.Lock]] = {}


def _is_feature(x: Any) -> bool:
    return isinstance(x, FeatureConfig)


class _Unreadable(Exception):
    """An entry ``seq`` (or the chain from it) that ``refresh`` could not read: ``error``."""

    def __init__(self, seq: int, error: fmt.PublishError) -> None:
        super().__init__(seq, error)
        self.seq, self.error = seq, error


class PublishedModule(ServingModule):
    """The newest state of a publish directory as a ``ServingModule``, with ``refresh()``.

    Args:
        directory: the publish directory.
        quantize: as ``ServingModule``'s.

    Attributes:
        version: the sequence number of the entry it reflects.
        directory: where it reads.
    """

    def __init__(self, directory: Path, quantize: Any = None) -> None:
        def read(run: list[fmt.Entry], manifests: list[dict[str, Any]]
                 ) -> tuple[dict[str, Any], Any, dict[Any, str], dict[str, torch.Tensor]]:
            last = manifests[-1]
            template = EmbeddingSpec.from_dict(last["serving_spec"]).feature_config
            configs = list(dict.fromkeys(f.table for _, f in leaves_with_paths(template,
                                                                                _is_feature)))
            names = resolve_table_names(configs)
            shapes: dict[str, tuple[int, ...]] = {}
            for t, n in names.items():
                shapes[f"{n}/parameters"] = (t.vocabulary_size, t.dim)
                if t.dtype in SCALED:  # 8-bit rows: their codes and a scale per row
                    shapes[f"{n}/{SCALES}"] = (t.vocabulary_size, 1)
                if t.dynamic is not None:
                    shapes[f"{n}/{VOCAB}ids"] = (t.vocabulary_size, 1)
                    shapes[f"{n}/{VOCAB}last_use"] = (t.vocabulary_size, 1)
            return last, template, names, fmt.replay(run, manifests, shapes)  # (all checked)

        # (read again from the newest snapshot when retention removes an entry meanwhile)
        last, template, names, state = fmt.newest(directory, read)
        self_maps: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        vocabularies = {}
        for t, n in names.items():
            if t.dynamic is not None:
                ids, used = state[f"{n}/{VOCAB}ids"][:, 0], state[f"{n}/{VOCAB}last_use"][:, 0] > 0
                self_maps[n] = (ids, used)
                vocabularies[t] = _resident(ids, used)
        super().__init__(template, {t: _served_rows(state, n) for t, n in names.items()},
                         names, vocabularies, quantize=quantize)
        self.directory = directory
        self.version: int = last["seq"]
        self._id: str = last["id"]
        self._spec = last["serving_spec"]
        self._maps = self_maps  # dynamic table -> (id of each row (N,), row in use (N,))
        self._dims = {n: t.dim for t, n in names.items()}
        _LOCKS[id(self)] = (ReadWriteLock(), threading.Lock())

    def __del__(self) -> None:
        _LOCKS.pop(id(self), None)

    def _locks(self) -> tuple[ReadWriteLock, threading.Lock]:
        got = _LOCKS.get(id(self))
        if got is None:  # (a copy of the module)
            got = _LOCKS[id(self)] = (ReadWriteLock(), threading.Lock())
        return got

    def _reading(self) -> contextlib.AbstractContextManager[Any]:
        return self._locks()[0].read()

    def reading(self) -> contextlib.AbstractContextManager[Any]:
        """Held around several lookups (and what goes with them), they all see one version:
        ``with served.reading(): ...``. A refresh waits for it to be released."""
        return self._locks()[0].read()

    def refresh(self, on_entry: Callable[[Mapping[str, Any]], None] | None = None) -> int:
        """Applies every entry published after ``version``, in order, each as one unit (see
        the module's docstring); returns how many.

        Args:
            on_entry: called with each entry's manifest at the moment the entry becomes what
                lookups see (under the write lock, so keep it short): to switch what serves
                beside the tables (a dense model published with them) in the same step. When
                it raises, the entry is still applied whole, then its error is raised (later
                entries are not applied).

        An entry that cannot be read (corrupt, missing, out of the chain) is skipped when a
        newer snapshot follows it: the module starts over from the newest snapshot, as
        ``load_published`` would, and a ``RuntimeWarning`` names what it skipped. Without a
        newer snapshot the error is raised; a later refresh tries again. An entry the trainer's
        retention removes while it is read is no error: the refresh reads on from where it is
        (from the newest snapshot when it fell behind), ``fmt.READ_TRIES`` times at most.

        Raises:
            PublishError (a ValueError): a corrupt or missing entry, or a broken chain, that no
                newer snapshot follows; an entry of another chain (copied in from another
                directory); or a directory now holding another model (other tables): the
                module keeps the last entry it applied.
        """
        if on_entry is not None and not callable(on_entry):
            raise TypeError(f"on_entry must be a callable taking an entry's manifest, got "
                            f"{type(on_entry).__name__}")
        _, one = self._locks()
        with one:  # one refresh at a time
            applied = [0]
            skipped = False  # (past an unreadable entry: from the newest snapshot)
            gone: fmt.EntryGone | None = None
            for _ in range(fmt.READ_TRIES):
                try:
                    try:
                        run = fmt.chain(self.directory,
                                        None if skipped else (self.version, self._id))
                    except fmt.PublishError as e:  # (a missing entry, a broken chain)
                        raise _Unreadable(self.version + 1, e) from e
                    self._apply_entries(run, on_entry, applied)
                    return applied[0]
                except _Unreadable as bad:
                    if isinstance(bad.error, fmt.EntryGone):  # (retention: read on)
                        gone = bad.error
                        continue
                    if skipped:
                        raise bad.error from None
                    newest = [e.seq for e in fmt.entries(self.directory)
                              if e.kind == "snapshot" and e.seq > bad.seq]
                    if not newest:
                        raise bad.error from None
                    warnings.warn(
                        f"{self.directory}: entry {bad.seq} cannot be read ({bad.error}); "
                        f"skipped entries {bad.seq}..{newest[-1] - 1} and started over from "
                        f"snapshot {newest[-1]}", RuntimeWarning, stacklevel=2)
                    skipped = True
            raise fmt.removed_too_often(self.directory, gone)

    def _apply_entries(self, run_of: list[fmt.Entry],
                       on_entry: Callable[[Mapping[str, Any]], None] | None,
                       applied: list[int]) -> None:
        """Applies ``run_of`` in order (``refresh``'s loop), counting into ``applied[0]``; an
        entry that cannot be read raises ``_Unreadable`` (nothing of it applied)."""
        rw, _ = self._locks()
        for entry in run_of:
            try:
                m = entry.manifest()
            except fmt.PublishError as e:
                raise _Unreadable(entry.seq, e) from e
            if m.get("serving_spec") != self._spec:
                raise fmt.PublishError(
                    f"{entry.path} publishes another model (its tables or features "
                    f"differ from the ones this module serves); load the directory again "
                    f"with ec.load_published")
            try:
                writes, maps, overlays = self._prepare(entry, m)
            except fmt.PublishError as e:
                raise _Unreadable(entry.seq, e) from e
            with rw.write():  # the entry becomes what lookups see: the maps, the rows
                for _, buffer, rows, values in writes:
                    if rows is None:
                        buffer.copy_(values)
                self._overlays = overlays
                self._maps.update(maps)
                self.version, self._id = m["seq"], m["id"]
                failed = None
                if on_entry is not None:
                    try:
                        on_entry(m)
                    except Exception as e:  # (raised once the entry is applied whole)
                        failed = e
            for name in overlays:  # lookups read a table's overlay while it is written
                for table, buffer, rows, values in writes:
                    if table == name and rows is not None:
                        buffer.index_copy_(0, rows, values)
                with rw.write():  # (its rows now hold its overlay's values)
                    self._overlays = {k: v for k, v in self._overlays.items() if k != name}
            applied[0] += 1
            if failed is not None:
                raise failed

    def _prepare(self, entry: fmt.Entry, m: Mapping[str, Any]
                 ) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor]],
                            dict[str, tuple[torch.Tensor, torch.Tensor]],
                            dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """What applying ``entry`` writes: ``(table, buffer, rows or None for all, values)``; the
        dynamic tables' new maps (the id of each row, whether it is in use); and per table the
        changed rows and their values as lookups read them (the overlay lookups use while the
        rows are written)."""
        pieces: dict[str, list[tuple[torch.Tensor, tuple[int, int] | None, torch.Tensor]]] = {}
        maps: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for part in fmt.read_entry(entry, m):
            time.sleep(0)  # (lets lookups' threads run between the parts' work)
            for name in fmt.tables_in(part):
                if name not in self.precisions:
                    continue
                rows = part[f"{name}/rows"]
                cols = part.get(f"{name}/columns")
                pieces.setdefault(name, []).append(
                    (rows, None if cols is None else (int(cols[0]), int(cols[1])),
                     _served_rows(part, name)))
                if name in self._maps:
                    maps.setdefault(name, []).append(
                        (rows, part[f"{name}/{VOCAB}ids"][:, 0],
                         part[f"{name}/{VOCAB}last_use"][:, 0] > 0))
        writes: list[tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        overlays: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, got in pieces.items():
            time.sleep(0)
            rows = torch.unique(torch.cat([r for r, _, _ in got]))  # (U,) ascending
            values = torch.zeros(rows.numel(), self._dims[name])
            for r, span, v in got:
                at = torch.searchsorted(rows, r)
                if span is None:
                    values[at] = v.to(values.dtype)
                else:
                    values[at, span[0]:span[1]] = v.to(values.dtype)
            precision = self.precisions[name]
            if precision is None:
                buffer = getattr(self, self.buffer_name(name))
                writes.append((name, buffer, rows, values.to(buffer.dtype)))
                overlays[name] = (rows, writes[-1][3])
            else:
                q = quantize_table(values, precision, name=name, rows=rows)
                writes.append((name, getattr(self, self.buffer_name(name)), rows, q.data))
                if q.scale is not None and q.bias is not None:  # (int8: both)
                    writes.append((name, getattr(self, self.buffer_name(name, "__scale")), rows,
                                   q.scale))
                    writes.append((name, getattr(self, self.buffer_name(name, "__bias")), rows,
                                   q.bias))
                overlays[name] = (rows, q.dequantize())
        new_maps = {}
        for name, changed in maps.items():
            ids, used = (t.clone() for t in self._maps[name])
            for rows, i, u in changed:
                ids[rows], used[rows] = i, u
            new_maps[name] = (ids, used)
            sorted_ids, sorted_rows = _resident(ids, used)
            padded = padded_map(sorted_ids, sorted_rows, ids.numel())
            writes.append((name, getattr(self, self.buffer_name(name, "__ids")), None,
                           padded[0]))
            writes.append((name, getattr(self, self.buffer_name(name, "__rows")), None,
                           padded[1]))
        return writes, new_maps, overlays


def _served_rows(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """Table ``name``'s rows in ``state`` (an entry's part or the replayed whole) as served: an
    8-bit table's codes widened with their scales (``code * scale``, float32)."""
    rows = state[f"{name}/parameters"]
    if rows.dtype not in SCALED:
        return rows
    scales = state.get(f"{name}/{SCALES}")
    if scales is None:
        raise fmt.PublishError(f"table {name!r}: its {str(rows.dtype).removeprefix('torch.')} "
                               f"rows came without their scales ({name}/{SCALES})")
    return widen(rows, scales)


def _resident(ids: torch.Tensor, used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids ascending, rows) of the rows in use of a map held as the id of each row."""
    rows = used.nonzero().squeeze(1)
    order = torch.argsort(ids[rows], stable=True)
    return ids[rows][order], rows[order]
