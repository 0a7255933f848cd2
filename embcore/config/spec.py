"""Declarative configuration: ``ec.EmbeddingSpec``, the analogue of TF's EmbeddingConfigSpec.

Everything an engine is built from, as data: tables (shared by name), features in their nested
structure, per-table and default optimizers with their options, dynamic vocabularies, sharding,
memory budget, pipelining and the exchange's compression. ``to_dict()`` is JSON-safe and
``from_dict`` rebuilds the same spec (``from_dict(s.to_dict()) == s``; specs compare by their
dicts). A callable that cannot be written
as data (a learning-rate schedule, a gradient multiplier, an initializer) is a ``ValueError``
naming it, except the named initializers: ``functools.partial`` of ``torch.nn.init``'s
``uniform_``, ``normal_``, ``trunc_normal_``, ``constant_``, ``zeros_`` or ``ones_`` with number
arguments. Checkpoints store the spec of the engine they saved in their manifest
(``EmbeddingSpec.from_checkpoint``), so a served model can be rebuilt from its checkpoint alone.

``from_dict`` is strict: it takes what ``to_dict`` writes and nothing else. A value of the wrong
type (``"pipeline_execution": "no"``) is a ``TypeError``; an unknown or missing key (at the top,
in a table, a feature, an optimizer, a dynamic vocabulary or an initializer), a table no feature
uses, a structure nested more than ``nest.MAX_DEPTH`` deep, or a value out of range (sizes
beyond the bounds of ``config/tables.py``, an initializer's NaN ``std`` or ``a > b``) a
``ValueError``; each names the key and where it is. Nothing is ignored or replaced by a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..base.nest import check_depth, leaves_with_paths
from .budget import parse_budget
from .exchange import ExchangeCompression
from .optimizers import Optimizer, records
from .tables import DynamicVocabulary, FeatureConfig, TableConfig, resolve_table_names

T = TypeVar("T")

FORMAT = "embcore-spec-1"
OPTIMIZERS = {r.name: r.cls for r in records()}  # the spec's "class" names: the optimizers' records
INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "zeros_", "ones_")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn,
          "float8_e5m2": torch.float8_e5m2}
# The keys to_dict writes, at each level; from_dict refuses any other.
SPEC_KEYS = ("format", "tables", "features", "optimizer", "sharding", "memory_budget",
             "pipeline_execution", "exchange_compression")
TABLE_KEYS = ("vocabulary_size", "dim", "initializer", "optimizer", "combiner", "dtype",
              "dynamic", "stochastic_rounding")
FEATURE_KEYS = ("table", "max_sequence_length", "output_shape", "validate_weights_and_indices",
                "name")
DYNAMIC_KEYS = tuple(f.name for f in dataclasses.fields(DynamicVocabulary))
INITIALIZER_KEYS = ("torch.nn.init", "kwargs")


def _is_feature(x: Any) -> bool:
    return isinstance(x, FeatureConfig)


@dataclasses.dataclass(frozen=True, eq=False)
class EmbeddingSpec:
    """What ``ec.Embedding`` / ``ec.EmbeddingLayer`` are built from, as data.

    Args:
        feature_config: a FeatureConfig or a nested dict (str keys) / list / tuple of them.
        optimizer: the default embcore optimizer (tables may carry their own), or None.

    The keyword-only args (sharding, memory_budget, pipeline_execution,
    exchange_compression) are those of ``ec.Embedding``.

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
    exchange_compression: ExchangeCompression | str | None = dataclasses.field(default=None,
                                                                               kw_only=True)

    def __post_init__(self) -> None:
        if self.optimizer is not None and not isinstance(self.optimizer, Optimizer):
            raise TypeError(f"EmbeddingSpec: optimizer must be an embcore optimizer or None, got "
                            f"{type(self.optimizer).__name__}")
        parse_budget(self.memory_budget)
        ExchangeCompression.of(self.exchange_compression)
        if not isinstance(self.pipeline_execution, bool):
            raise TypeError(f"EmbeddingSpec: pipeline_execution must be a bool, got "
                            f"{type(self.pipeline_execution).__name__} "
                            f"{self.pipeline_execution!r}")
        sharding = self.sharding
        if not (sharding is None or isinstance(sharding, str) or (
                isinstance(sharding, Mapping)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in sharding.items()))):
            raise TypeError(f"EmbeddingSpec: sharding must be None, a strategy name or a dict "
                            f"{{table name: strategy name}} of strings, got {sharding!r}")
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
        "memory_budget", "pipeline_execution", "exchange_compression"}``; tables by resolved
        name (the compression always as ``{"forward", "backward", "error_feedback"}``)."""
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
                "pipeline_execution": self.pipeline_execution,
                "exchange_compression": ExchangeCompression.of(
                    self.exchange_compression).to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EmbeddingSpec:
        """The spec ``to_dict`` wrote (``optimizer``, ``sharding``, ``memory_budget``,
        ``pipeline_execution`` and ``exchange_compression`` may be left out: None, None, None,
        false, fp32).

        Raises:
            ValueError: anything else ``to_dict`` could not have written, naming the key and
                where it is: not a spec (no ``format``), an unknown or missing key (``table
                'users': unknown key 'initialiser'``), a value out of range (sizes, an
                initializer's arguments: what ``TableConfig``, ``FeatureConfig``,
                ``DynamicVocabulary`` and the optimizers refuse), a table no feature uses.
            TypeError: a value of the wrong type (``spec: pipeline_execution must be true or
                false, got str 'no'``; a string size), naming the key.
        """
        got = d.get("format") if isinstance(d, Mapping) else None
        if got != FORMAT:
            raise ValueError(f"not an embcore spec (format {got!r}, expected {FORMAT!r})")
        _keys(d, "not an embcore spec", SPEC_KEYS, required=("format", "tables", "features"))
        if not isinstance(d.get("pipeline_execution", False), bool):
            raise TypeError(f"spec: pipeline_execution must be true or false, got "
                            f"{_kind(d['pipeline_execution'])}")
        tables_d = _mapping(d["tables"], "spec: tables")
        try:
            tables = {name: _table_from(t, name) for name, t in tables_d.items()}
            features = _structure_from(d["features"], tables, "", 0)
            used = {f.table for _, f in leaves_with_paths(features, _is_feature)}
            unused = [name for name, t in tables.items() if t not in used]
            if unused:
                raise ValueError(f"spec: table {unused[0]!r} is used by no feature (tables: "
                                 f"{sorted(tables)})")
            compression = d.get("exchange_compression")
            return cls(features, _optimizer_from(d.get("optimizer"), "the default optimizer"),
                       sharding=d.get("sharding"), memory_budget=d.get("memory_budget"),
                       pipeline_execution=d.get("pipeline_execution", False),
                       exchange_compression=None if compression is None
                       else ExchangeCompression.from_dict(compression))
        except (KeyError, AttributeError) as e:  # (none expected: every part is checked)
            raise ValueError(f"not an embcore spec: {e!r}") from None

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike) -> EmbeddingSpec:
        """The spec stored in an ``ec.save`` checkpoint's manifest.

        Raises:
            ValueError: no spec there (saved by an older embcore, or its engine had callables
                that are not data: the manifest's ``spec_error`` says which), a manifest that is
                not a JSON object, or a spec ``from_dict`` refuses (a ``TypeError`` for a value
                of the wrong type, as there).
        """
        file = Path(path) / "manifest.json"
        try:
            manifest = json.loads(file.read_text(encoding="utf-8"))
        except RecursionError:
            raise ValueError(f"{file}: nested too deep to be a checkpoint manifest") from None
        if type(manifest) is not dict:  # a JSON value that is no object: a bad file, ValueError
            raise ValueError(f"{file}: not a checkpoint manifest (a JSON object), got a JSON "
                             f"{_kind(manifest)}")
        spec = manifest.get("spec")
        if spec is None:
            raise ValueError(f"{path}: the checkpoint holds no spec "
                             f"({manifest.get('spec_error', 'saved before specs existed')})")
        return cls.from_dict(spec)

    @classmethod
    def manifest_entry(cls, feature_config: Any, optimizer: Optimizer | None, sharding: Any,
                       memory_budget: Any, pipeline_execution: bool,
                       exchange_compression: Any = None) -> dict[str, Any]:
        """What a checkpoint's manifest says of the engine built from these arguments:
        ``{"spec": its spec as data}``, or ``{"spec": None, "spec_error": why}`` when a callable
        in it is not data (``from_checkpoint`` reads it)."""
        try:
            spec = cls(feature_config, optimizer, sharding=sharding, memory_budget=memory_budget,
                       pipeline_execution=pipeline_execution,
                       exchange_compression=exchange_compression)
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
                f.name: getattr(t.dynamic, f.name) for f in dataclasses.fields(t.dynamic)},
            "stochastic_rounding": t.stochastic_rounding}


def _table_from(d: Any, name: Any) -> TableConfig:
    if not isinstance(name, str):
        raise TypeError(f"spec: tables: a table's name must be a string, got {_kind(name)}")
    where = f"table {name!r}"
    _keys(d, where, TABLE_KEYS, required=("vocabulary_size", "dim", "combiner", "dtype"))
    if not isinstance(d["dtype"], str):
        raise TypeError(f"{where}: dtype must be a string, one of {sorted(DTYPES)}, got "
                        f"{_kind(d['dtype'])}")
    if d["dtype"] not in DTYPES:
        raise ValueError(f"{where}: unknown dtype {d['dtype']!r}; one of {sorted(DTYPES)}")
    dynamic = d.get("dynamic")
    if dynamic is not None:
        _keys(dynamic, f"{where}: dynamic", DYNAMIC_KEYS)
    return TableConfig(vocabulary_size=d["vocabulary_size"], dim=d["dim"],
                       initializer=_initializer_from(d.get("initializer"), name),
                       optimizer=_optimizer_from(d.get("optimizer"), f"{where}'s optimizer"),
                       combiner=d["combiner"], name=name, dtype=DTYPES[d["dtype"]],
                       dynamic=None if dynamic is None else DynamicVocabulary(**dynamic),
                       stochastic_rounding=d.get("stochastic_rounding", True))


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
    """The initializer ``_initializer`` wrote; its arguments' types are checked here, their
    names and values (finite, ``a <= b``, ``std >= 0``) by ``TableConfig``
    (``tables.check_init_partial``)."""
    if d is None:
        return None
    where = f"table {table!r}: initializer"
    _keys(d, where, INITIALIZER_KEYS, required=("torch.nn.init",))
    func = d["torch.nn.init"]
    if func not in INITIALIZERS:  # (a list or dict is not in the tuple either)
        raise ValueError(f"table {table!r}: unknown initializer {d!r}; "
                         f"'torch.nn.init' is one of {INITIALIZERS}")
    kwargs = _mapping(d.get("kwargs", {}), f"{where}: kwargs")
    for k, v in kwargs.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{where}: argument {k!r} of {func} must be a number, got "
                            f"{_kind(v)}")
    return functools.partial(getattr(torch.nn.init, func), **kwargs)


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
    _mapping(d, what)
    name = d.get("class")
    cls = OPTIMIZERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"{what}: unknown optimizer {name!r}; one of "
                         f"{sorted(OPTIMIZERS)}")
    _keys(d, f"{what} ({name})", ("class", *(f.name for f in dataclasses.fields(cls)
                                              if f.name != "_")))
    kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()
                              if k != "class"}
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


def _structure_from(x: Any, tables: Mapping[str, TableConfig], path: str, depth: int) -> Any:
    """The features ``_structure`` wrote (``path``: where ``x`` is, ``depth``: the containers
    above it)."""
    where = f"features[{path!r}]" if path else "features"
    if isinstance(x, Mapping) and "__feature__" in x:
        _keys(x, where, ("__feature__",))
        f = dict(_keys(x["__feature__"], f"feature {path or '(the top)'!r}", FEATURE_KEYS,
                       required=("table",)))
        table = f.pop("table")
        if not isinstance(table, str):
            raise TypeError(f"feature {path or '(the top)'!r}: table must be a table's name, "
                            f"got {_kind(table)}")
        if table not in tables:
            raise ValueError(f"feature {path or '(the top)'!r}: unknown table {table!r}; the "
                             f"spec's tables are {sorted(tables)}")
        return FeatureConfig(table=tables[table], **f)
    if not isinstance(x, (Mapping, list)):
        raise TypeError(f"{where}: expected a feature, an object, a list or a tuple, got "
                        f"{_kind(x)}")
    check_depth(depth + 1, where)

    def sub(key: Any) -> str:
        return f"{path}/{key}" if path else str(key)

    if isinstance(x, Mapping) and "__tuple__" in x:
        _keys(x, where, ("__tuple__",))
        if not isinstance(x["__tuple__"], list):
            raise TypeError(f"{where}: __tuple__ must be a list, got {_kind(x['__tuple__'])}")
        return tuple(_structure_from(v, tables, sub(i), depth + 1)
                     for i, v in enumerate(x["__tuple__"]))
    if isinstance(x, Mapping):
        for k in x:
            if not isinstance(k, str) or k.startswith("__"):
                raise ValueError(f"{where}: unknown key {k!r} (a feature is "
                                 f"{{'__feature__': ...}}, a tuple {{'__tuple__': [...]}}; other "
                                 f"keys must not start with '__')")
        return {k: _structure_from(v, tables, sub(k), depth + 1) for k, v in x.items()}
    return [_structure_from(v, tables, sub(i), depth + 1) for i, v in enumerate(x)]


# -------------------------------------------------------------------------------- checks
def _kind(value: Any) -> str:
    """A JSON value's kind and value for messages: ``str 'no'``, ``list [1]``."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _mapping(d: Any, where: str) -> Mapping[str, Any]:
    """``d`` when it is a mapping (a JSON object), else a TypeError naming ``where``."""
    if not isinstance(d, Mapping):
        raise TypeError(f"{where} must be an object (a dict), got {_kind(d)}")
    return d


def _keys(d: Any, where: str, allowed: tuple[str, ...],
          required: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """``d`` when it is a mapping with only ``allowed`` keys and every ``required`` one, else a
    ValueError naming the first unknown (and the allowed key it resembles) or missing key (a
    TypeError when it is not a mapping)."""
    _mapping(d, where)
    for k in d:
        if k not in allowed:
            close = difflib.get_close_matches(k, allowed, n=1) if isinstance(k, str) else []
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"{where}: unknown key {k!r} ({hint}the keys are {list(allowed)})")
    for k in required:
        if k not in d:
            raise ValueError(f"{where}: missing key {k!r}")
    return d


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
               exchange_compression=spec.exchange_compression, **kwargs)
