"""Serving: lookups with plain torch ops on plain tensors, and the exportable serving module.

``serving_embedding_lookup`` computes exactly what the engine's lookup computes (the same bags from
inputs.py, the same ``combine`` from ops/combine.py), from tables given as tensors: no engine, no
optimizer, no queue. It is differentiable w.r.t. the tables, which is how
``EmbeddingLayer(optimizer=None)`` trains them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .config import FeatureConfig, TableConfig, resolve_table_names
from .features import is_feature as _is_feature
from .inputs import canonicalize, resolve_shape
from .nest import (flatten_like, from_keyed_jagged, is_keyed_jagged, leaves_with_paths,
                   unflatten_like)
from .ops.combine import combine


def lookup_feature(feature: FeatureConfig, name: str, table_name: str, table: torch.Tensor,
                   ids: torch.Tensor, weights: torch.Tensor | None = None,
                   vocabulary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One feature's activation from its table tensor: ``leading shape + (D,)``.

    A dynamic table's ``table`` is its ``(N + 1, D)`` rows with a last row of zeros, and
    ``vocabulary`` its resident ``(ids ascending, rows)``: raw ids become rows by a sorted search
    (plain torch ops, exportable); ids not resident read the zero row."""
    bags = canonicalize(feature, name, table_name, ids, weights, table.device)
    shape = resolve_shape(feature, name, bags.shape, None)
    index = bags.ids
    if vocabulary is not None:
        index = rows_of(index, vocabulary[0], vocabulary[1], table.shape[0] - 1)
    return combine(table, index, bags).view(*shape, table.shape[1])  # shape + (D,)


def rows_of(ids: torch.Tensor, vocab_ids: torch.Tensor, vocab_rows: torch.Tensor,
            zero_row: int) -> torch.Tensor:
    """(n,) rows of raw ids ``ids`` (n,) in a map of sorted ``vocab_ids`` (R,) -> ``vocab_rows``;
    ``zero_row`` for ids not in it."""
    if vocab_ids.numel() == 0:
        return torch.full_like(ids, zero_row)
    pos = torch.searchsorted(vocab_ids, ids).clamp(max=vocab_ids.numel() - 1)  # (n,)
    return torch.where(vocab_ids[pos] == ids, vocab_rows[pos], zero_row)


def with_zero_row(table: torch.Tensor) -> torch.Tensor:
    """(N + 1, D): a dynamic table's rows and the zero row ids not resident read."""
    return torch.cat([table, table.new_zeros(1, table.shape[1])])


def _dynamic_entry(value: Any, name: str) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A dynamic table's ``(table, ids, rows)`` from ``tables``, checked."""
    if not (isinstance(value, tuple) and len(value) == 3
            and all(isinstance(v, torch.Tensor) for v in value)):
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
    """

    def __init__(self, feature_config: Any, tables: Mapping[TableConfig, torch.Tensor],
                 table_names: Mapping[TableConfig, str],
                 vocabularies: Mapping[TableConfig, tuple[torch.Tensor, torch.Tensor]]
                 | None = None) -> None:
        super().__init__()
        self.feature_config = feature_config
        flat = leaves_with_paths(feature_config, _is_feature)
        self._paths = [f.name or p for p, f in flat]
        self._table_of = [table_names[f.table] for _, f in flat]
        self._dynamic = [f.table.dynamic is not None for _, f in flat]
        for _, f in flat:
            key = table_names[f.table]
            if hasattr(self, key):
                continue
            if f.table.dynamic is None:
                self.register_buffer(key, tables[f.table].detach().clone())
                continue
            assert vocabularies is not None, "a dynamic table is served with its map"
            ids, rows = vocabularies[f.table]
            self.register_buffer(key, with_zero_row(tables[f.table].detach()))
            self.register_buffer(key + "__ids", ids.clone())
            self.register_buffer(key + "__rows", rows.clone())

    def forward(self, features: Any, weights: Any = None) -> Any:
        flat = [f for _, f in leaves_with_paths(self.feature_config, _is_feature)]
        if is_keyed_jagged(features):
            features, weights = from_keyed_jagged(self.feature_config, features)
        flat_ids = flatten_like(self.feature_config, features, _is_feature, "features")
        flat_w = (flatten_like(self.feature_config, weights, _is_feature, "weights")
                  if weights is not None else [None] * len(flat))
        out = [lookup_feature(f, n, t, getattr(self, t), ids, w,
                              (getattr(self, t + "__ids"), getattr(self, t + "__rows"))
                              if dyn else None)
               for f, n, t, dyn, ids, w in zip(flat, self._paths, self._table_of, self._dynamic,
                                               flat_ids, flat_w)]
        return unflatten_like(self.feature_config, out, _is_feature)
