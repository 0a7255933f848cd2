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
from collections.abc import Mapping
from typing import Any

import torch

from ..base.nest import (
    flatten_like,
    from_keyed_jagged,
    is_keyed_jagged,
    leaves_with_paths,
    unflatten_like,
)
from ..config.tables import FeatureConfig, TableConfig, resolve_table_names
from ..inputs.canonical import canonicalize, resolve_shape
from ..inputs.features import is_feature as _is_feature
from ..ops.combine import combine
from .quantize import QuantizedTable, quantize_table, resolve_quantize

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
    bags = canonicalize(feature, name, table_name, ids, weights, table.device)
    shape = resolve_shape(feature, name, bags.shape, None)
    index = bags.ids
    if vocabulary is not None:
        index = rows_of(index, vocabulary[0], vocabulary[1], table.shape[0] - 1)
    if isinstance(table, QuantizedTable) or overlay is not None:
        rows = table.rows(index) if isinstance(table, QuantizedTable) else \
            table.index_select(0, index)  # (nnz, D), only the rows read
        if overlay is not None:
            rows = _overlaid(rows, index, *overlay)
        out = rows if bags.unit else combine(rows, _positions(index), bags)  # (R, D)
    else:
        out = combine(table, index, bags)  # (R, D)
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
        inputs, weights = from_keyed_jagged(feature_config, inputs)
    features = [f for _, f in flat]
    names = resolve_table_names(list(dict.fromkeys(f.table for f in features)))
    flat_ids = flatten_like(feature_config, inputs, _is_feature, "inputs")
    flat_w = (flatten_like(feature_config, weights, _is_feature, "weights") if weights is not None
              else [None] * len(features))
    out = []
    for (path, f), ids, w in zip(flat, flat_ids, flat_w):
        table = tables.get(f.table) if f.table in tables else tables.get(names[f.table])
        if table is None:
            raise KeyError(f"feature {f.name or path!r}: no tensor for table {names[f.table]!r} "
                           f"in tables")
        vocab = None
        if f.table.dynamic is not None:
            table, vocab = _dynamic_entry(table, names[f.table])
        out.append(lookup_feature(f, f.name or path, names[f.table], table, ids, w, vocab))
    return unflatten_like(feature_config, out, _is_feature)


class ServingModule(torch.nn.Module):
    """Tables as buffers and a forward of plain torch ops; ``torch.export``-able with dense ids,
    sparse COO ids and jagged ``(values, offsets)`` pairs.

    Made by ``EmbeddingLayer.for_serving()``; holds a snapshot of the tables, no optimizer slots.
    A table served quantized (``precisions``: ``"int8"`` / ``"fp16"``, quantize.py) is held as
    its codes (buffer ``<table>``) and, for int8, ``<table>__scale`` and ``<table>__bias``; its
    lookups dequantize the rows they read, and give float32 activations.
    """

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
        for table, key in served.items():
            dynamic = table.dynamic is not None
            rows = tables[table].detach()
            rows = with_zero_row(rows) if dynamic else rows  # (N (+ 1), D)
            if precisions[table] is None:
                self.register_buffer(key, rows if dynamic else rows.clone())
            else:
                q = quantize_table(rows, precisions[table], name=key)
                self.register_buffer(key, q.data)
                if q.scale is not None:
                    self.register_buffer(key + "__scale", q.scale)
                    self.register_buffer(key + "__bias", q.bias)
            if dynamic:
                assert vocabularies is not None, "a dynamic table is served with its map"
                ids, map_rows = padded_map(*vocabularies[table], rows.shape[0] - 1)
                self.register_buffer(key + "__ids", ids)
                self.register_buffer(key + "__rows", map_rows)

    def _table(self, name: str) -> Table:
        """Table ``name`` as its lookups read it: a tensor, or a ``QuantizedTable`` over the
        buffers (a dynamic table with its zero row last)."""
        precision = self.precisions[name]
        if precision is None:
            return getattr(self, name)
        if precision == "fp16":
            return QuantizedTable("fp16", getattr(self, name))
        return QuantizedTable("int8", getattr(self, name), getattr(self, name + "__scale"),
                              getattr(self, name + "__bias"))

    def table_bytes(self) -> dict[str, int]:
        """Bytes of each table's rows as held (codes, scales and biases; not the id maps)."""
        return {name: self._table(name).nbytes for name in self.precisions}

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
            features, weights = from_keyed_jagged(self.feature_config, features)
        flat_ids = flatten_like(self.feature_config, features, _is_feature, "features")
        flat_w = (flatten_like(self.feature_config, weights, _is_feature, "weights")
                  if weights is not None else [None] * len(flat))
        overlays = self._overlays
        out = [lookup_feature(f, n, t, self._table(t), ids, w,
                              (getattr(self, t + "__ids"), getattr(self, t + "__rows"))
                              if dyn else None, overlays.get(t))
               for f, n, t, dyn, ids, w in zip(flat, self._paths, self._table_of, self._dynamic,
                                               flat_ids, flat_w)]
        return unflatten_like(self.feature_config, out, _is_feature)
