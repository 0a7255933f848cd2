"""The features of an engine: their structure, names, tables, shapes, and a batch's bags.

``Features`` is what an engine knows of its ``feature_config``: the nested structure (the template
every features / weights / activations / gradients structure mirrors), the flat list of
FeatureConfigs with their resolved names, the tables they read and each feature's fixed activation
shape (docs/semantics.md section 1). ``bags`` turns a user's batch into one ``Bags`` per feature
(canonical.py), validated as a whole before anything changes; ``Shapes`` says how a batch's shapes
meet the fixed ones.
"""

from __future__ import annotations

import enum
from dataclasses import replace
from typing import Any

import torch

from ..base.nest import (
    Structure,
    flatten_like,
    leaves_with_paths,
)
from ..config.optimizers import Optimizer
from ..config.tables import FeatureConfig, TableConfig, resolve_table_names
from ..ops.backend import Backend
from ..ops.bags import Bags
from .canonical import (
    BatchChecks,
    Verdicts,
    canonicalize,
    output_shape_from_input_shape,
    resolve_shape,
)
from .kjt import from_keyed_jagged, is_keyed_jagged


class Shapes(enum.Enum):
    """How a batch's activation shapes meet the shapes fixed so far (``output_shape``,
    ``build``, or an earlier batch)."""

    FIX = "fix"      # must equal the fixed shape; a feature with none is fixed by the batch
    CHECK = "check"  # must equal the fixed shape; fixes nothing (the layer: batch sizes vary)
    ANY = "any"      # any shape (``lookup``: only ``output_shape`` applies)


def is_feature(x: Any) -> bool:
    return isinstance(x, FeatureConfig)


def _sizes(shape: Any, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of ints >= 1 (TypeError for non-ints, ValueError below 1)."""
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{what} must be a sequence of ints, got {type(shape).__name__}")
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"{what}: {s!r} is not an int (sizes are ints >= 1)")
        if s < 1:
            raise ValueError(f"{what}: {s} is below 1 (sizes are ints >= 1)")
    return tuple(shape)


class Features:
    """The flat view of a feature_config, and the shapes fixed so far.

    Raises:
        ValueError / TypeError: an empty or malformed structure, duplicate feature names, one
            FeatureConfig used twice, a bad optimizer.
    """

    def __init__(self, feature_config: Any, optimizer: Optimizer | None) -> None:
        self.template = feature_config
        flat = leaves_with_paths(feature_config, is_feature)
        if not flat:
            raise ValueError("feature_config holds no FeatureConfig")
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an embcore optimizer (ec.SGD, ec.Adagrad, ...) or "
                            f"None, got {type(optimizer).__name__}")
        self.configs: list[FeatureConfig] = [f for _, f in flat]
        self.names = [f.name or (p or "feature") for p, f in flat]
        dup = {n for n in self.names if self.names.count(n) > 1}
        if dup:
            raise ValueError(f"feature names {sorted(dup)} are used twice; give features unique "
                             f"names")
        if len({id(f) for f in self.configs}) != len(self.configs):
            raise ValueError("one FeatureConfig object appears twice in feature_config; create a "
                             "FeatureConfig per feature (they may share a TableConfig)")
        tables = list(dict.fromkeys(f.table for f in self.configs))  # first-use order
        self.table_names: dict[TableConfig, str] = resolve_table_names(tables)
        self.optimizers = {t: t.optimizer if t.optimizer is not None else optimizer
                           for t in tables}
        self.tables = [self.table_names[f.table] for f in self.configs]  # per feature
        self.shapes: list[tuple[int, ...] | None] = [None] * len(self.configs)
        # build()'s input shapes whose output shape depends on the input kind (dense or bags),
        # resolved by each batch's kind until a batch fixes the shape
        self.declared: list[tuple[int, ...] | None] = [None] * len(self.configs)
        self._index = {id(f): i for i, f in enumerate(self.configs)}
        self._untrained = tuple(self.table_names[t] for t, o in self.optimizers.items()
                                if o is None)
        self._all = range(len(self.configs))
        # its structures' flattening (a flat dict template, the common case: by key)
        self.structure = Structure(feature_config, is_feature)

    def __len__(self) -> int:
        return len(self.configs)

    def table_specs(self) -> list[tuple[str, TableConfig, Optimizer | None]]:
        """(name, config, effective optimizer) of every table, in first-use order (for the plan)."""
        return [(n, t, self.optimizers[t]) for t, n in self.table_names.items()]

    def lookups_per_table(self) -> dict[str, int]:
        return {n: self.tables.count(n) for n in self.table_names.values()}

    def check_trainable(self, hint: str = "") -> None:
        """Raises ValueError naming the tables without an optimizer (fixed at construction),
        which a training batch cannot update; ``hint`` ends the message (another way out)."""
        if self._untrained:
            raise ValueError(f"tables {list(self._untrained)} have no optimizer, so they cannot "
                             f"be trained; pass optimizer= to Embedding (or to their "
                             f"TableConfig){hint}")

    def table_name(self, table: TableConfig | str) -> str:
        """The name of one of these features' tables, given as its config or its name.

        Raises:
            ValueError: a table no feature reads.
        """
        name = self.table_names.get(table) if isinstance(table, TableConfig) else table
        if name is None or name not in self.table_names.values():
            raise ValueError(f"{table!r} is not a table of this engine; its tables are "
                             f"{sorted(self.table_names.values())}")
        return name

    def fix_shapes(self, per_replica_input_shapes: Any = None,
                   per_replica_batch_size: int | None = None) -> None:
        """``build()``'s shapes (docs/semantics.md section 1); a conflict changes nothing.

        Raises:
            TypeError: a size that is not an int. ValueError: a size below 1, a structure
                mismatch, or a shape conflicting with one already fixed.
        """
        shapes: list[tuple[int, ...] | None] = [None] * len(self)
        declared: list[tuple[int, ...] | None] = [None] * len(self)
        if per_replica_input_shapes is not None:
            flat = flatten_like(self.template, per_replica_input_shapes, is_feature,
                                "per_replica_input_shapes")
            given = [_sizes(s, f"feature {n!r}: per_replica_input_shapes") for s, n in
                     zip(flat, self.names)]
            declared = list(given)
            shapes = [output_shape_from_input_shape(f, s, n, None)
                      for f, s, n in zip(self.configs, given, self.names)]
        elif per_replica_batch_size is not None:
            (b,) = _sizes((per_replica_batch_size,), "per_replica_batch_size")
            shapes = [(b, f.sequence_length) if f.sequence_length else (b,)
                      for f in self.configs]
        for i, (s, d) in enumerate(zip(shapes, declared)):
            have, name, f = self.shapes[i], self.names[i], self.configs[i]
            options = [s] if s is not None else [
                output_shape_from_input_shape(f, d, name, k) for k in (True, False)] if d else []
            if have is not None and options and have not in options:
                raise ValueError(f"feature {name!r}: build() shape {list(s or d or ())} conflicts "
                                 f"with the shape {list(have)} already fixed")
        for i, (s, d) in enumerate(zip(shapes, declared)):
            if s is not None:
                self.shapes[i], self.declared[i] = s, None
            elif d is not None and self.shapes[i] is None:
                self.declared[i] = d

    def serving_bags(self, template: Any, features: Any, weights: Any, device: torch.device,
                     backend: Backend) -> tuple[list[Bags | None], list[str]]:
        """Bags of a lookup through ``template`` (default: this engine's features), any shape.

        ``template`` may hold this engine's FeatureConfigs or other FeatureConfigs reading this
        engine's tables (TF's ``serving_config``: the same tables, other batch shapes).

        Returns:
            (one ``Bags`` per leaf of ``template``, each leaf's table name), in flatten order.

        Raises:
            ValueError: a feature reading a table this engine does not have.
        """
        leaves = leaves_with_paths(template, is_feature)
        flat_ids, flat_w = _flat_inputs(template, features, weights, len(leaves))
        out: list[Bags | None] = []
        tables: list[str] = []
        checks = BatchChecks(backend)  # (offsets and ids, read back once for the batch)
        made = []
        for (path, f), ids, w in zip(leaves, flat_ids, flat_w):
            i = self._index.get(id(f))
            if i is None and f.table not in self.table_names:
                raise ValueError(f"serving_config: feature {f.name or path!r} reads table "
                                 f"{f.table.name!r}, which this engine does not have; its "
                                 f"tables: {sorted(self.table_names.values())}")
            name = self.names[i] if i is not None else (f.name or path or "feature")
            table = self.table_names[f.table]
            made.append((f, name, ids, canonicalize(f, name, table, ids, w, device, backend,
                                                    checks)))
            tables.append(table)
        checks.done()
        out = [_shaped(f, name, ids, b, None) for f, name, ids, b in made]
        return out, tables

    def bags(self, features: Any, weights: Any, device: torch.device, backend: Backend,
             shapes: Shapes, verdicts: Verdicts | None = None) -> list[Bags | None]:
        """One ``Bags`` per feature of a batch, its shapes as ``shapes`` says (``Shapes.ANY``:
        ``serving_bags`` of these features). Nothing changes unless the whole batch is valid;
        with ``verdicts`` (a training batch on the Triton backend) the values it would read
        back are judged on the device instead: each ``Bags`` carries the batch's verdict,
        and a bad batch changes nothing (``Verdicts``).

        Raises:
            ValueError / TypeError: bad structures, ids, weights or shapes, naming the feature.
        """
        if shapes is Shapes.ANY:
            return self.serving_bags(self.template, features, weights, device, backend)[0]
        flat_ids, flat_w = _flat_inputs(self.template, features, weights, len(self._all))
        checks = BatchChecks(backend, verdicts)  # (offsets and ids, read back once a batch)
        made = [canonicalize(self.configs[i], self.names[i], self.tables[i], ids, w, device,
                             backend, checks) for i, ids, w in zip(self._all, flat_ids, flat_w)]
        verdict = checks.done()  # (then the shapes: a bad id is named before a shape that differs)
        if verdict is not None:  # (judged on the device: each feature's bags carry it)
            made = [replace(b, verdict=verdict) for b in made]
        out: list[Bags | None] = [_shaped(self.configs[i], self.names[i], ids, b,
                                          self.shapes[i], self.declared[i])
                                  for i, ids, b in zip(self._all, flat_ids, made)]
        if shapes is Shapes.FIX:
            for i, b in enumerate(out):
                if b is not None and self.shapes[i] is None and not self.configs[i].output_shape:
                    self.shapes[i], self.declared[i] = b.shape, None
        return out

    def describe(self, plan: Any) -> dict[str, Any]:
        """``{"tables": {name: {...}}, "features": [...]}``, JSON-able (checkpoint manifests)."""
        tables = {name: {"vocabulary_size": t.vocabulary_size, "dim": t.dim,
                         "combiner": t.combiner, "dtype": str(t.dtype).replace("torch.", ""),
                         "optimizer": None if self.optimizers[t] is None
                         else repr(self.optimizers[t]),
                         "slots": list(plan.table(name).slot_names),
                         "dynamic": t.dynamic.describe() if t.dynamic is not None else None}
                  for t, name in self.table_names.items()}
        features = [{"name": n, "table": tn, "max_sequence_length": c.max_sequence_length}
                    for n, tn, c in zip(self.names, self.tables, self.configs)]
        return {"tables": tables, "features": features}

    def unflatten(self, flat: list[Any]) -> Any:
        """The feature_config structure from per-feature values (flat order)."""
        return self.structure.unflatten(flat)

    def flatten(self, value: Any, what: str) -> list[Any]:
        """``value``'s leaves in flatten order (``what`` names it in errors)."""
        return self.structure.flatten(value, what)

    def flat_dict(self, value: Any) -> list[Any] | None:
        """``value``'s leaves when feature_config is a flat dict and ``value`` a dict of exactly
        its keys; None otherwise (``flatten`` then walks it, or says what differs)."""
        return self.structure.flat_dict(value)


def _flat_inputs(template: Any, features: Any, weights: Any,
                 n: int) -> tuple[list[Any], list[Any]]:
    """The ids and weights of a batch in ``template``'s flatten order (a KeyedJaggedTensor is
    split by key first)."""
    if is_keyed_jagged(features):
        features, weights = from_keyed_jagged(template, features, weights)
    flat_ids = flatten_like(template, features, is_feature, "features")
    flat_w = (flatten_like(template, weights, is_feature, "weights") if weights is not None
              else [None] * n)
    return flat_ids, flat_w


def _shaped(feature: FeatureConfig, name: str, ids: Any, b: Bags,
            fixed: tuple[int, ...] | None, declared: tuple[int, ...] | None = None) -> Bags:
    """One feature's canonical ``b`` (of input ``ids``), its shape resolved (``fixed``: the
    shape fixed so far, or None; ``declared``: build()'s input shape, read by this batch's
    kind, when nothing is fixed)."""
    if fixed is None and declared is not None:
        dense = (isinstance(ids, torch.Tensor) and ids.layout == torch.strided
                 and not ids.is_nested)
        fixed = output_shape_from_input_shape(feature, declared, name, dense)
    shape = resolve_shape(feature, name, b.shape, fixed)
    return b if shape == b.shape else replace(b, shape=shape)
