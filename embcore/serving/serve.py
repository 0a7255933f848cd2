"""Serving: lookups with plain torch ops on plain tensors, and the exportable serving module.

``serving_embedding_lookup`` computes exactly what the engine's lookup computes (the same bags from
inputs/canonical.py, the same ``combine`` from ops/combine.py), from tables given as tensors: no
engine, no optimizer, no queue. It is differentiable w.r.t. the tables, which is how
``EmbeddingLayer(optimizer=None)`` trains them. A table may also be a ``QuantizedTable``
(quantize.py: int8 row-wise or fp16): the rows a batch reads are gathered quantized, dequantized
to float32, then combined by the same ``combine``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, overload

import torch

from ..base.compat import size_oblivious_export
from ..base.nest import (
    flatten_like,
    leaves_with_paths,
    unflatten_like,
)
from ..config.tables import FeatureConfig, TableConfig, resolve_table_names
from ..inputs.canonical import canonicalize, input_kind, resolve_shape
from ..inputs.features import is_feature as _is_feature
from ..inputs.kjt import from_keyed_jagged, is_keyed_jagged
from ..numerics.rounding import clamp_fix, narrowed_for_load
from ..ops.backend import choose
from ..ops.combine import combine
from .package import package_program
from .quantize import QuantizedTable, check_not_scaled, quantize_table, resolve_quantize

Table = torch.Tensor | QuantizedTable  # (N, D) rows, plain or quantized


def lookup_feature(feature: FeatureConfig, name: str, table_name: str, table: Table,
                   ids: torch.Tensor, weights: torch.Tensor | None = None,
                   vocabulary: tuple[torch.Tensor, torch.Tensor] | None = None,
                   overlay: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One feature's activation from its table: ``leading shape + (D,)``.

    A dynamic table's ``table`` is its ``(N + 1, D)`` rows with a last row of zeros, and
    ``vocabulary`` its resident ``(ids ascending, rows)``: raw ids become rows by a sorted search
    (plain torch ops, exportable); ids not resident read the zero row. A quantized table's rows
    are gathered, dequantized (float32), then combined: the result equals combining the
    dequantized table, bit for bit. ``overlay``: ``(rows (U,) ascending, values (U, D))`` read
    in place of the table's (a refresh writing those rows, serving/follow.py)."""
    backend = choose(table.device)  # (the tables served as tensors: no engine chose it)
    bags = canonicalize(feature, name, table_name, ids, weights, table.device, backend)
    shape = resolve_shape(feature, name, bags.shape, None)
    index = bags.ids
    if vocabulary is not None:
        index = rows_of(index, vocabulary[0], vocabulary[1], table.shape[0] - 1)
    if isinstance(table, QuantizedTable) or overlay is not None:
        rows = table.rows(index) if isinstance(table, QuantizedTable) else \
            table.index_select(0, index)  # (nnz, D), only the rows read
        if overlay is not None:
            rows = _overlaid(rows, index, *overlay)
        out = rows if bags.unit else combine(rows, _positions(index), bags,
                                             backend=backend)  # (R, D)
    else:
        out = combine(table, index, bags, backend=backend)  # (R, D)
    return out.view(*shape, table.shape[1])  # shape + (D,)


def _overlaid(rows: torch.Tensor, index: torch.Tensor, at: torch.Tensor,
              values: torch.Tensor) -> torch.Tensor:
    """``rows`` (n, D), gathered at ``index`` (n,), with those in ``at`` (U,) ascending taken
    from ``values`` (U, D)."""
    if at.numel() == 0:
        return rows
    pos = torch.searchsorted(at, index).clamp(max=at.numel() - 1)  # (n,)
    hit = (at.index_select(0, pos) == index).nonzero().squeeze(1)  # (h,) positions in index
    return rows.index_copy_(0, hit, values.index_select(0, pos.index_select(0, hit))
                            .to(rows.dtype))


def _positions(index: torch.Tensor) -> torch.Tensor:
    """(n,) 0 .. n-1, each occurrence's own gathered row. Derived from ``index``, not
    ``arange(n)``: a sparse input's entry count is not a traced size under torch.export, and an
    ``arange`` would bake the traced batch's count into the program."""
    return torch.ones_like(index).cumsum(0) - 1


def rows_of(ids: torch.Tensor, vocab_ids: torch.Tensor, vocab_rows: torch.Tensor,
            zero_row: int) -> torch.Tensor:
    """(n,) rows of raw ids ``ids`` (n,) in a map of sorted ``vocab_ids`` (R,) -> ``vocab_rows``;
    ``zero_row`` for ids not in it."""
    if vocab_ids.numel() == 0:
        return torch.full_like(ids, zero_row)
    pos = torch.searchsorted(vocab_ids, ids).clamp(max=vocab_ids.numel() - 1)  # (n,)
    return torch.where(vocab_ids[pos] == ids, vocab_rows[pos], zero_row)


def padded_map(ids: torch.Tensor, rows: torch.Tensor, capacity: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A served map of a dynamic table of ``capacity`` rows as ``capacity`` sorted ids and their
    rows: the resident ``ids`` (R,) ascending and ``rows`` (R,), then ``capacity - R`` entries of
    the largest int64 that lead to the zero row (``capacity``). A fixed size lets a refresh
    rewrite the map in place, where an exported program reads it; an id equal to the padding
    that is resident comes first and is found."""
    pad = capacity - ids.numel()
    ids = torch.cat([ids.to(torch.int64), ids.new_full((pad,), torch.iinfo(torch.int64).max,
                                                       dtype=torch.int64)])
    rows = torch.cat([rows.to(torch.int64), rows.new_full((pad,), capacity, dtype=torch.int64)])
    return ids, rows


def _tracing() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _dynamic_dims(x: Any, where: str) -> Any:
    """One input leaf's ``dynamic_shapes`` entry: every dim of every tensor ``Dim.AUTO`` (a dense
    id tensor, a sparse COO tensor, or a ``(values, offsets)`` pair: a tuple of two)."""
    if x is None:
        return None
    if isinstance(x, tuple) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(_dynamic_dims(t, where) for t in x)
    if isinstance(x, torch.Tensor) and x.is_nested:
        raise TypeError(f"{where}: torch.export cannot take nested tensors as inputs; give a "
                        f"jagged batch as a (values, offsets) pair of tensors")
    try:
        input_kind(x)
    except TypeError as e:
        raise TypeError(f"{where}: {e}") from None
    auto = getattr(torch.export.Dim, "AUTO", None)
    if auto is None:  # (torch before 2.6)
        raise RuntimeError("dynamic_shapes needs torch.export.Dim.AUTO (torch >= 2.6)")
    return dict.fromkeys(range(x.dim()), auto)


def _mirror(template: Any, value: Any, leaf: Any, path: str = "") -> Any:
    """``value`` (shaped like ``template``, checked) with each leaf ``v`` at ``path`` replaced by
    ``leaf(v, path)``; its containers as ``value`` has them (torch.export matches
    ``dynamic_shapes`` to the inputs' own structure)."""
    if _is_feature(template):
        return leaf(value, path)
    if isinstance(template, dict):
        return {k: _mirror(template[k], v, leaf, f"{path}/{k}" if path else str(k))
                for k, v in value.items()}
    items = [_mirror(t, v, leaf, f"{path}/{i}" if path else str(i))
             for i, (t, v) in enumerate(zip(template, value))]
    if isinstance(value, tuple):
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return items


def _bracketed(template: Any, value: Any, path: str, out: list[tuple[str, Any, Any]]) -> None:
    """``(path, feature, value)`` of each feature of ``template`` in ``value`` (shaped like it),
    its path written ``features['a'][0]`` as serving/package.py names inputs."""
    if _is_feature(template):
        out.append((path, template, value))
    elif isinstance(template, dict):
        for k in template:
            _bracketed(template[k], value[k], f"{path}[{k!r}]", out)
    else:
        for i, (t, v) in enumerate(zip(template, value)):
            _bracketed(t, v, f"{path}[{i}]", out)


@overload
def with_zero_row(table: torch.Tensor) -> torch.Tensor: ...
@overload
def with_zero_row(table: QuantizedTable) -> QuantizedTable: ...
def with_zero_row(table: Table) -> Table:
    """(N + 1, D): a dynamic table's rows and the zero row ids not resident read."""
    if isinstance(table, QuantizedTable):
        return table.with_zero_row()
    return torch.cat([table, table.new_zeros(1, table.shape[1])])


def _dynamic_entry(value: Any, name: str) -> tuple[Table, tuple[torch.Tensor, torch.Tensor]]:
    """A dynamic table's ``(table, ids, rows)`` from ``tables``, checked."""
    if not (isinstance(value, tuple) and len(value) == 3
            and isinstance(value[0], torch.Tensor | QuantizedTable)
            and all(isinstance(v, torch.Tensor) for v in value[1:])):
        raise TypeError(f"table {name!r} is dynamic (raw ids): give it as (table, ids, rows), "
                        f"e.g. (emb.embedding_tables[t], *emb.vocabulary(t)), got "
                        f"{type(value).__name__}")
    table, ids, rows = value
    if ids.dim() != 1 or ids.shape != rows.shape or (ids.numel() and int(rows.max()) >=
                                                      table.shape[0]):
        raise ValueError(f"table {name!r}: ids and rows must be 1-D of one length, rows "
                         f"below {table.shape[0]}")
    return with_zero_row(table), (ids.to(torch.int64), rows.to(torch.int64))


def serving_embedding_lookup(inputs: Any, weights: Any, tables: Mapping[Any, torch.Tensor],
                             feature_config: Any) -> Any:
    """Activations for ``inputs`` from plain table tensors, as the engine's lookup gives them.

    Args:
        inputs: mirrors feature_config; dense, jagged or sparse COO id tensors.
        weights: None, or mirrors feature_config with None or weight tensors.
        tables: ``{TableConfig: (N, D) tensor}`` (e.g. ``emb.embedding_tables``) or
            ``{table name: tensor}``; a dynamic table's value is ``(table (N, D), ids (R,)
            ascending, rows (R,))``, e.g. ``(emb.embedding_tables[t], *emb.vocabulary(t))``.
            A table may be an ``ec.quantize_table(...)`` in place of its tensor (float32
            activations, from the dequantized rows).
        feature_config: a FeatureConfig or a nested structure of them.

    Returns:
        Activations mirroring feature_config.

    Example:
        >>> import torch, embcore as ec
        >>> t = ec.TableConfig(vocabulary_size=4, dim=2, combiner="sum", name="t")
        >>> f = ec.FeatureConfig(table=t)
        >>> table = torch.arange(8.).view(4, 2)
        >>> ec.serving_embedding_lookup(torch.tensor([3]), None, {t: table}, f)
        tensor([[6., 7.]])
    """
    flat = leaves_with_paths(feature_config, _is_feature)
    if is_keyed_jagged(inputs):
        inputs, weights = from_keyed_jagged(feature_config, inputs, weights)
    features = [f for _, f in flat]
    names = resolve_table_names(list(dict.fromkeys(f.table for f in features)))
    flat_ids = flatten_like(feature_config, inputs, _is_feature, "inputs")
    flat_w = (flatten_like(feature_config, weights, _is_feature, "weights") if weights is not None
              else [None] * len(features))
    out = []
    for (path, f), ids, w in zip(flat, flat_ids, flat_w):
        table: Table | None = (tables.get(f.table) if f.table in tables
                               else tables.get(names[f.table]))
        if table is None:
            raise KeyError(f"feature {f.name or path!r}: no tensor for table {names[f.table]!r} "
                           f"in tables")
        vocab = None
        if f.table.dynamic is not None:
            table, vocab = _dynamic_entry(table, names[f.table])
        if isinstance(table, torch.Tensor):
            check_not_scaled(table, names[f.table])
        out.append(lookup_feature(f, f.name or path, names[f.table], table, ids, w, vocab))
    return unflatten_like(feature_config, out, _is_feature)


class ServingModule(torch.nn.Module):
    """Tables as buffers and a forward of plain torch ops; ``torch.export``-able with dense ids,
    sparse COO ids and jagged ``(values, offsets)`` pairs.

    Made by ``EmbeddingLayer.for_serving()``; holds a snapshot of the tables, no optimizer slots.
    A table served quantized (``precisions``: ``"int8"`` / ``"fp16"``, quantize.py) is held as
    its codes (buffer ``<table>``) and, for int8, ``<table>__scale`` and ``<table>__bias``; its
    lookups dequantize the rows they read, and give float32 activations. A dynamic table's map
    is ``<table>__ids`` and ``<table>__rows``.

    Buffers are named after their tables, except a table whose name cannot name a buffer of
    this module (an attribute or method of it such as ``forward``, ``training`` or
    ``table_bytes``, a name holding ``'.'``, or one another table's buffers take): its buffers
    are ``table__<name>...`` (``'.'`` written ``%2E``, ``'%'`` ``%25``). ``buffer_name(table,
    suffix)`` gives the name of any of them.

    ``export(features)`` (or ``torch.export.export(module, args,
    dynamic_shapes=module.dynamic_shapes(*args))``) gives a program that serves batches of any
    size and any number of ids.
    """

    # The parts of a table held as buffers: ``buffer_name(table, suffix)``.
    BUFFER_SUFFIXES = ("", "__scale", "__bias", "__ids", "__rows")
    # Attributes a subclass sets after the buffers are registered (serving/follow.py's
    # PublishedModule), which a table's buffers must leave free.
    _SET_AFTER_BUFFERS = frozenset({"directory", "version", "_id", "_spec", "_maps", "_dims"})

    def __init__(self, feature_config: Any, tables: Mapping[TableConfig, torch.Tensor],
                 table_names: Mapping[TableConfig, str],
                 vocabularies: Mapping[TableConfig, tuple[torch.Tensor, torch.Tensor]]
                 | None = None, quantize: Any = None) -> None:
        super().__init__()
        self.feature_config = feature_config
        # {table: (rows, values)} read in place of the buffers' rows (serving/follow.py)
        self._overlays: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        flat = leaves_with_paths(feature_config, _is_feature)
        self._paths = [f.name or p for p, f in flat]
        self._table_of = [table_names[f.table] for _, f in flat]
        self._dynamic = [f.table.dynamic is not None for _, f in flat]
        served = {f.table: table_names[f.table] for _, f in flat}
        precisions = resolve_quantize(quantize, served)
        self.precisions: dict[str, str | None] = {n: precisions[t] for t, n in served.items()}
        # {table name: the first part of its buffers' names} (buffer_name)
        self._buffer_names: dict[str, str] = self._name_buffers(served.values())
        for table, key in served.items():
            dynamic = table.dynamic is not None
            rows = tables[table].detach()
            rows = with_zero_row(rows) if dynamic else rows  # (N (+ 1), D)
            precision = precisions[table]
            if precision is None:
                self.register_buffer(self.buffer_name(key), rows if dynamic else rows.clone())
            else:
                q = quantize_table(rows, precision, name=key)
                self.register_buffer(self.buffer_name(key), q.data)
                if q.scale is not None:
                    self.register_buffer(self.buffer_name(key, "__scale"), q.scale)
                    self.register_buffer(self.buffer_name(key, "__bias"), q.bias)
            if dynamic:
                assert vocabularies is not None, "a dynamic table is served with its map"
                ids, map_rows = padded_map(*vocabularies[table], rows.shape[0] - 1)
                self.register_buffer(self.buffer_name(key, "__ids"), ids)
                self.register_buffer(self.buffer_name(key, "__rows"), map_rows)

    def _name_free(self, name: str, taken: set[str]) -> bool:
        """Whether ``name`` can name a buffer: no ``'.'``, not an attribute of this module (its
        class's or its own, or one a subclass sets later) nor taken by another table."""
        return ("." not in name and name not in taken and name not in self._SET_AFTER_BUFFERS
                and not hasattr(type(self), name) and name not in self.__dict__)

    def _name_buffers(self, names: Iterable[str]) -> dict[str, str]:
        """Each table's buffer name (its name, else ``table__<name escaped>``): the tables
        whose names are free keep them, the others take escaped names left free, in order."""
        names = list(names)
        taken: set[str] = set()
        out: dict[str, str] = {}

        def fits(base: str) -> bool:
            return all(self._name_free(base + s, taken) for s in self.BUFFER_SUFFIXES)

        for name in names:  # first the names that are free, so that they never change
            if fits(name):
                out[name] = name
                taken.update(name + s for s in self.BUFFER_SUFFIXES)
        for name in names:
            if name in out:
                continue
            base = "table__" + name.replace("%", "%25").replace(".", "%2E")
            while not fits(base):
                base += "_"
            out[name] = base
            taken.update(base + s for s in self.BUFFER_SUFFIXES)
        return {name: out[name] for name in names}

    def buffer_name(self, table: str, suffix: str = "") -> str:
        """The name of table ``table``'s buffer ``suffix`` (one of ``BUFFER_SUFFIXES``: ``""``
        the rows or codes, ``"__scale"`` / ``"__bias"`` an int8 table's, ``"__ids"`` /
        ``"__rows"`` a dynamic table's map): ``table + suffix``, unless the table's name cannot
        name a buffer (see the class docstring). KeyError: a table not served here."""
        names = self.__dict__.get("_buffer_names")
        if names is None:  # (a module pickled before buffers had their own names)
            return table + suffix
        if table not in names:
            raise KeyError(f"{table!r} is not a table served here; the served tables are "
                           f"{sorted(names)}")
        return names[table] + suffix

    def _table(self, name: str) -> Table:
        """Table ``name`` as its lookups read it: a tensor, or a ``QuantizedTable`` over the
        buffers (a dynamic table with its zero row last)."""
        precision = self.precisions[name]
        rows = getattr(self, self.buffer_name(name))
        if precision is None:
            return rows
        if precision == "fp16":
            return QuantizedTable("fp16", rows)
        return QuantizedTable("int8", rows, getattr(self, self.buffer_name(name, "__scale")),
                              getattr(self, self.buffer_name(name, "__bias")))

    def table_bytes(self) -> dict[str, int]:
        """Bytes of each table's rows as held (codes, scales and biases; not the id maps)."""
        return {name: self._table(name).nbytes for name in self.precisions}

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str,
                              local_metadata: Any, strict: bool, missing_keys: list[str],
                              unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """torch's load of the buffers, a 16-bit one's values given wider narrowed as ``ec.load``
        narrows them (docs/semantics.md section 14): refused where they would become infinite,
        in torch's words, and then no buffer of this module is loaded."""
        before = len(error_msgs)
        for name, buffer in self._buffers.items():
            value = state_dict.get(prefix + name)
            if buffer is not None and value is not None and buffer.is_floating_point():
                try:
                    narrowed_for_load(value, buffer.dtype, f"{name}/rows",
                                      f"load_state_dict ({prefix}{name})", "the state_dict",
                                      False, clamp_fix(buffer.dtype))
                except ValueError as e:
                    error_msgs.append(str(e))
        if len(error_msgs) == before:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)

    def _reading(self) -> contextlib.AbstractContextManager[Any]:
        """Held by a lookup while it reads the buffers (a module that refreshes them in place,
        serving/follow.py, makes a lookup see them before or after a refresh, never between)."""
        return contextlib.nullcontext()

    def forward(self, features: Any, weights: Any = None) -> Any:
        if _tracing():  # (torch.export / compile trace the lookup alone)
            return self._forward(features, weights)
        with self._reading():
            return self._forward(features, weights)

    def _forward(self, features: Any, weights: Any) -> Any:
        flat = [f for _, f in leaves_with_paths(self.feature_config, _is_feature)]
        if is_keyed_jagged(features):
            features, weights = from_keyed_jagged(self.feature_config, features, weights)
        flat_ids = flatten_like(self.feature_config, features, _is_feature, "features")
        flat_w = (flatten_like(self.feature_config, weights, _is_feature, "weights")
                  if weights is not None else [None] * len(flat))
        overlays = self._overlays
        out = [lookup_feature(f, n, t, self._table(t), ids, w,
                              (getattr(self, self.buffer_name(t, "__ids")),
                               getattr(self, self.buffer_name(t, "__rows")))
                              if dyn else None, overlays.get(t))
               for f, n, t, dyn, ids, w in zip(flat, self._paths, self._table_of, self._dynamic,
                                               flat_ids, flat_w)]
        return unflatten_like(self.feature_config, out, _is_feature)

    def dynamic_shapes(self, *args: Any) -> tuple[Any, ...]:
        """``torch.export``'s ``dynamic_shapes`` for example inputs ``args`` (``(features,)`` or
        ``(features, weights)``, as passed to ``torch.export.export``): every dim of every input
        tensor ``torch.export.Dim.AUTO``, so the program serves any batch size and any number
        of ids (a dense input's sizes, a ``(values, offsets)`` pair's values and offsets, a
        sparse COO input's sizes; its number of entries is never fixed). A dim the lookup
        depends on stays as traced (e.g. a dense ``[B, 1]`` input's last dim).

        Without ``export()``'s size-oblivious tracing, torch's ops guard a jagged batch's bag
        count against 1: a program traced from two bags or more serves batches of two bags or
        more, one traced from a single bag serves single bags; ``export()`` lifts that.

        Raises:
            TypeError: not one or two arguments, a nested tensor (give a jagged batch as a
                ``(values, offsets)`` pair) or a KeyedJaggedTensor (give the features' ids).
            ValueError: a structure that does not mirror the module's feature_config.

        Example:
            >>> import torch, embcore as ec
            >>> t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
            >>> served = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, "sgd").for_serving()
            >>> args = ({"f": (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]))},)
            >>> served.dynamic_shapes(*args)
            ({'f': ({0: DimHint(AUTO)}, {0: DimHint(AUTO)})},)
        """
        if not 1 <= len(args) <= 2:
            raise TypeError(f"dynamic_shapes takes the example inputs (features,) or (features, "
                            f"weights), got {len(args)} arguments")
        out: list[Any] = []
        for value, what in zip(args, ("features", "weights")):
            if value is None:
                out.append(None)
                continue
            if is_keyed_jagged(value):
                raise TypeError(f"{what}: torch.export cannot take a KeyedJaggedTensor here; "
                                f"give each feature's ids as a (values, offsets) pair")
            flatten_like(self.feature_config, value, _is_feature, what)  # (checks the structure)
            out.append(_mirror(self.feature_config, value,
                               lambda x, path, what=what: _dynamic_dims(x, f"{what}[{path!r}]")))
        return tuple(out)

    def export(self, features: Any, weights: Any = None, **kwargs: Any
               ) -> torch.export.ExportedProgram:
        """``torch.export.export`` of this module with example ``features`` (and ``weights``):
        a program that serves batches of any size (one bag too) and any number of ids, dense,
        as ``(values, offsets)`` pairs or sparse COO, as the example's kinds are.

        ``dynamic_shapes`` defaults to ``dynamic_shapes(features[, weights])``; other keyword
        arguments go to ``torch.export.export``. The inputs' sizes are traced size-obliviously
        (torch's experimental switch for export), so a batch of 0 or 1 ids or bags is served
        like any other. A program checks no ids (docs/semantics.md): validate them before.

        Example:
            >>> import torch, embcore as ec
            >>> t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
            >>> served = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, "sgd").for_serving()
            >>> program = served.export({"f": (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]))})
            >>> program.module()({"f": (torch.arange(7), torch.tensor([0, 7]))})["f"].shape
            torch.Size([1, 2])
        """
        args = (features,) if weights is None else (features, weights)
        if "dynamic_shapes" not in kwargs:
            kwargs["dynamic_shapes"] = self.dynamic_shapes(*args)
        with size_oblivious_export():
            return torch.export.export(self, args, **kwargs)

    def compile_package(self, path: str | os.PathLike[str], features: Any, weights: Any = None,
                        *, inductor_configs: dict[str, Any] | None = None, progress: bool = True,
                        **kwargs: Any) -> Path:
        """An AOTInductor package of ``export(features, weights, **kwargs)``: the lookups (and
        their tables, quantized or not, and dynamic tables' maps) compiled to a shared library
        inside one ``.pt2`` file, served without Python embcore. Returns ``path``.

        ``ec.load_package(path)`` loads it after verifying the checksums it carries (of every
        member; the compiled library holds the tables), and its calls check their inputs against
        the example's: structure, dtypes, ranks, contiguity, jagged offsets, weights, a static
        table's ids in range; they take the inputs ``export`` was given, of any batch size and
        number of ids, and answer as this module does, bit for bit on the CPU
        (docs/semantics.md section 12). AOTInductor's own loader (in torch's inductor module;
        ``torch::inductor::AOTIModelPackageLoader`` from C++) loads it in a process that has
        torch alone, checking neither the bytes nor the inputs (a
        column ``batch[:, 0]``, int32 ids or ``(B, 2)`` ids give wrong rows there). Compiling
        needs a C++ compiler and takes seconds to minutes (``progress``: a line to stderr
        before and after); ``inductor_configs`` go to AOTInductor's compiler.

        Raises:
            ValueError: ``path`` does not end in ``.pt2`` (AOTInductor's package suffix).
            RuntimeError: this torch has no AOTInductor (torch >= 2.6 has it).

        Example:
            >>> import torch, embcore as ec
            >>> t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
            >>> served = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, "sgd").for_serving()
            >>> example = {"f": (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]))}  # 2 bags
            >>> path = served.compile_package("lookup.pt2", example)  # doctest: +SKIP

            >>> ec.load_package(path)(example)["f"].shape  # doctest: +SKIP
            torch.Size([2, 2])
        """
        path = Path(path)
        if path.suffix != ".pt2":
            raise ValueError(f"compile_package: {path} must end in .pt2 (AOTInductor loads "
                             f"packages by that suffix)")
        program = self.export(features, weights, **kwargs)
        return package_program(program, path, inductor_configs=inductor_configs,
                               roles=self._roles(features, weights), progress=progress)

    def _roles(self, features: Any, weights: Any) -> dict[str, tuple[str, str, int | None]]:
        """``{input name: (role, feature, rows)}`` of example inputs, named as
        ``package_program`` names them (``features['bag'][0]``): ``"ids"`` / ``"offsets"`` /
        ``"weights"`` / ``"weight offsets"``, the feature's name, and its table's rows where
        ids index them (a static table), else None."""
        out: dict[str, tuple[str, str, int | None]] = {}
        for arg, value, roles in (("features", features, ("ids", "offsets")),
                                  ("weights", weights, ("weights", "weight offsets"))):
            found: list[tuple[str, Any, Any]] = []
            if value is not None:
                _bracketed(self.feature_config, value, arg, found)
            for name, (path, f, x) in zip(self._paths, found):
                rows = f.table.vocabulary_size if f.table.dynamic is None and \
                    roles[0] == "ids" else None
                if isinstance(x, tuple):  # (values, offsets)
                    out[f"{path}[0]"] = (roles[0], name, rows)
                    out[f"{path}[1]"] = (roles[1], name, None)
                elif x is not None:
                    out[path] = (roles[0], name, rows)
        return out
