"""Declarative configuration: ``ec.EmbeddingSpec``, the analogue of TF's EmbeddingConfigSpec.

Everything an engine is built from, as data: tables (shared by name), features in their nested
structure, per-table and default optimizers with their options, dynamic vocabularies, sharding,
memory budget and pipelining. ``to_dict()`` is JSON-safe and ``from_dict`` rebuilds the same spec
(``from_dict(s.to_dict()) == s``; specs compare by their dicts). A callable that cannot be written
as data (a learning-rate schedule, a gradient multiplier, an initializer) is a ``ValueError``
naming it, except the named initializers: ``functools.partial`` of ``torch.nn.init``'s
``uniform_``, ``normal_``, ``trunc_normal_``, ``constant_``, ``zeros_`` or ``ones_`` with number
arguments. Checkpoints store the spec of the engine they saved in their manifest
(``EmbeddingSpec.from_checkpoint``), so a served model can be rebuilt from its checkpoint alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..base.nest import leaves_with_paths
from .budget import parse_budget
from .optimizers import FTRL, SGD, Adagrad, AdagradMomentum, Adam, Optimizer, RowwiseAdagrad
from .tables import DynamicVocabulary, FeatureConfig, TableConfig, resolve_table_names

T = TypeVar("T")

FORMAT = "embcore-spec-1"
OPTIMIZERS = {c.__name__: c for c in (SGD, Adagrad, RowwiseAdagrad, AdagradMomentum, Adam, FTRL)}
INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "zeros_", "ones_")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}


def _is_feature(x: Any) -> bool:
    return isinstance(x, FeatureConfig)


@dataclasses.dataclass(frozen=True, eq=False)
class EmbeddingSpec:
    """What ``ec.Embedding`` / ``ec.EmbeddingLayer`` are built from, as data.

    Args:
        feature_config: a FeatureConfig or a nested dict (str keys) / list / tuple of them.
        optimizer: the default embcore optimizer (tables may carry their own), or None.
        sharding, memory_budget, pipeline_execution: as for ``ec.Embedding``.

    Raises:
        ValueError: something that cannot be written as data (naming it), or a bad budget.
        TypeError: a structure or optimizer of the wrong kind.

    Example:
        >>> import json, embcore as ec
        >>> t = ec.TableConfig(vocabulary_size=100, dim=8, name="items")
        >>> spec = ec.EmbeddingSpec({"item": ec.FeatureConfig(table=t)}, ec.Adagrad(
        ...     learning_rate=0.1), memory_budget="1GiB")
        >>> again = ec.EmbeddingSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
        >>> again == spec
        True
        >>> emb = ec.Embedding.from_spec(again)
    """

    feature_config: Any
    optimizer: Optimizer | None = None
    sharding: str | Mapping[str, str] | None = dataclasses.field(default=None, kw_only=True)
    memory_budget: int | str | None = dataclasses.field(default=None, kw_only=True)
    pipeline_execution: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if self.optimizer is not None and not isinstance(self.optimizer, Optimizer):
            raise TypeError(f"EmbeddingSpec: optimizer must be an embcore optimizer or None, got "
                            f"{type(self.optimizer).__name__}")
        parse_budget(self.memory_budget)
        if not isinstance(self.pipeline_execution, bool):
            raise TypeError("EmbeddingSpec: pipeline_execution must be a bool")
        self.to_dict()  # everything must be data

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EmbeddingSpec):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    # ---------------------------------------------------------------------------- to data
    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict: ``{"format", "tables", "features", "optimizer", "sharding",
        "memory_budget", "pipeline_execution"}``; tables by resolved name."""
        leaves = [f for _, f in leaves_with_paths(self.feature_config, _is_feature)]
        if not leaves:
            raise ValueError("EmbeddingSpec: feature_config holds no FeatureConfig")
        names = resolve_table_names(list(dict.fromkeys(f.table for f in leaves)))
        tables = {name: _table(t, name) for t, name in names.items()}
        sharding = self.sharding if not isinstance(self.sharding, Mapping) else dict(
            self.sharding)
        return {"format": FORMAT, "tables": tables,
                "features": _structure(self.feature_config, names),
                "optimizer": _optimizer(self.optimizer, "the default optimizer"),
                "sharding": sharding, "memory_budget": self.memory_budget,
                "pipeline_execution": self.pipeline_execution}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EmbeddingSpec:
        """The spec ``to_dict`` wrote. Raises ValueError for anything else, naming the part."""
        got = d.get("format") if isinstance(d, Mapping) else None
        if got != FORMAT:
            raise ValueError(f"not an embcore spec (format {got!r}, expected {FORMAT!r})")
        try:
            tables = {name: _table_from(t, name) for name, t in d["tables"].items()}
            return cls(_structure_from(d["features"], tables),
                       _optimizer_from(d.get("optimizer"), "the default optimizer"),
                       sharding=d.get("sharding"), memory_budget=d.get("memory_budget"),
                       pipeline_execution=bool(d.get("pipeline_execution", False)))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not an embcore spec: {e!r}") from None

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike) -> EmbeddingSpec:
        """The spec stored in an ``ec.save`` checkpoint's manifest.

        Raises:
            ValueError: no spec there (saved by an older embcore, or its engine had callables
                that are not data: the manifest's ``spec_error`` says which).
        """
        manifest = json.loads((Path(path) / "manifest.json").read_text(encoding="utf-8"))
        spec = manifest.get("spec")
        if spec is None:
            raise ValueError(f"{path}: the checkpoint holds no spec "
                             f"({manifest.get('spec_error', 'saved before specs existed')})")
        return cls.from_dict(spec)

    @classmethod
    def manifest_entry(cls, feature_config: Any, optimizer: Optimizer | None, sharding: Any,
                       memory_budget: Any, pipeline_execution: bool) -> dict[str, Any]:
        """What a checkpoint's manifest says of the engine built from these arguments:
        ``{"spec": its spec as data}``, or ``{"spec": None, "spec_error": why}`` when a callable
        in it is not data (``from_checkpoint`` reads it)."""
        try:
            spec = cls(feature_config, optimizer, sharding=sharding, memory_budget=memory_budget,
                       pipeline_execution=pipeline_execution)
            return {"spec": spec.to_dict()}
        except (ValueError, TypeError) as e:
            return {"spec": None, "spec_error": str(e)}


# -------------------------------------------------------------------------------- tables
def _table(t: TableConfig, name: str) -> dict[str, Any]:
    return {"vocabulary_size": t.vocabulary_size, "dim": t.dim,
            "initializer": _initializer(t.initializer, name),
            "optimizer": _optimizer(t.optimizer, f"table {name!r}'s optimizer"),
            "combiner": t.combiner, "dtype": str(t.dtype).replace("torch.", ""),
            "dynamic": None if t.dynamic is None else {
                f.name: getattr(t.dynamic, f.name) for f in dataclasses.fields(t.dynamic)}}


def _table_from(d: Mapping[str, Any], name: str) -> TableConfig:
    if d["dtype"] not in DTYPES:
        raise ValueError(f"table {name!r}: unknown dtype {d['dtype']!r}")
    return TableConfig(vocabulary_size=d["vocabulary_size"], dim=d["dim"],
                       initializer=_initializer_from(d.get("initializer"), name),
                       optimizer=_optimizer_from(d.get("optimizer"),
                                                 f"table {name!r}'s optimizer"),
                       combiner=d["combiner"], name=name, dtype=DTYPES[d["dtype"]],
                       dynamic=None if d.get("dynamic") is None else DynamicVocabulary(
                           **d["dynamic"]))


def _initializer(init: Any, table: str) -> Any:
    if init is None:
        return None
    if (isinstance(init, functools.partial) and not init.args
            and getattr(init.func, "__module__", "") == "torch.nn.init"
            and init.func.__name__ in INITIALIZERS
            and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                    for v in init.keywords.values())):
        return {"torch.nn.init": init.func.__name__, "kwargs": dict(init.keywords)}
    raise ValueError(f"table {table!r}: its initializer {init!r} is not data; a spec takes None "
                     f"(TF's truncated normal) or functools.partial(torch.nn.init.<f>, ...) with "
                     f"number arguments, f in {INITIALIZERS}")


def _initializer_from(d: Any, table: str) -> Any:
    if d is None:
        return None
    if d.get("torch.nn.init") not in INITIALIZERS:
        raise ValueError(f"table {table!r}: unknown initializer {d!r}")
    return functools.partial(getattr(torch.nn.init, d["torch.nn.init"]), **d.get("kwargs", {}))


# -------------------------------------------------------------------------------- optimizers
def _optimizer(opt: Optimizer | None, what: str) -> dict[str, Any] | None:
    if opt is None:
        return None
    if type(opt).__name__ not in OPTIMIZERS or OPTIMIZERS[type(opt).__name__] is not type(opt):
        raise ValueError(f"{what}: {type(opt).__name__} is not one of {sorted(OPTIMIZERS)}")
    out: dict[str, Any] = {"class": type(opt).__name__}
    for f in dataclasses.fields(opt):
        if f.name == "_":
            continue
        v = getattr(opt, f.name)
        if callable(v):
            raise ValueError(f"{what}: {f.name}={v!r} is a callable, which a spec cannot hold; "
                             f"give a number (or build the engine from code)")
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def _optimizer_from(d: Any, what: str) -> Optimizer | None:
    if d is None:
        return None
    cls = OPTIMIZERS.get(d.get("class"))
    if cls is None:
        raise ValueError(f"{what}: unknown optimizer {d.get('class')!r}; one of "
                         f"{sorted(OPTIMIZERS)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k != "class"}
    return cls(**kwargs)


# -------------------------------------------------------------------------------- features
def _structure(x: Any, names: Mapping[TableConfig, str]) -> Any:
    if isinstance(x, FeatureConfig):
        return {"__feature__": {
            "table": names[x.table], "max_sequence_length": x.max_sequence_length,
            "output_shape": None if x.output_shape is None else list(x.output_shape),
            "validate_weights_and_indices": x.validate_weights_and_indices, "name": x.name}}
    if isinstance(x, Mapping):
        bad = [k for k in x if not isinstance(k, str) or k.startswith("__")]
        if bad:
            raise ValueError(f"EmbeddingSpec: feature_config keys must be strings not starting "
                             f"with '__', got {bad}")
        return {k: _structure(v, names) for k, v in x.items()}
    if isinstance(x, tuple):
        return {"__tuple__": [_structure(v, names) for v in x]}
    if isinstance(x, list):
        return [_structure(v, names) for v in x]
    raise TypeError(f"EmbeddingSpec: feature_config holds a {type(x).__name__}; it must hold "
                    f"FeatureConfigs in dicts, lists and tuples")


def _structure_from(x: Any, tables: Mapping[str, TableConfig]) -> Any:
    if isinstance(x, Mapping) and "__feature__" in x:
        f = dict(x["__feature__"])
        table = tables[f.pop("table")]
        return FeatureConfig(table=table, **f)
    if isinstance(x, Mapping) and "__tuple__" in x:
        return tuple(_structure_from(v, tables) for v in x["__tuple__"])
    if isinstance(x, Mapping):
        return {k: _structure_from(v, tables) for k, v in x.items()}
    if isinstance(x, list):
        return [_structure_from(v, tables) for v in x]
    raise TypeError(f"unexpected {type(x).__name__} in the spec's features")


def from_spec(cls: Callable[..., T], spec: EmbeddingSpec, **kwargs: Any) -> T:
    """The engine or layer (``cls``: ``ec.Embedding.from_spec``, ``ec.EmbeddingLayer.from_spec``)
    that ``spec`` describes; ``kwargs``: the arguments a spec does not hold (``process_group``,
    ``device``, ``timeout``, ``offload_dir``, ``profile``).

    Raises:
        TypeError: ``spec`` is not an ``ec.EmbeddingSpec``.
    """
    if not isinstance(spec, EmbeddingSpec):
        raise TypeError(f"from_spec takes an ec.EmbeddingSpec, got {type(spec).__name__}")
    return cls(spec.feature_config, spec.optimizer, sharding=spec.sharding,
               memory_budget=spec.memory_budget, pipeline_execution=spec.pipeline_execution,
               **kwargs)
