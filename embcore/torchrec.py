"""TorchRec's ``EmbeddingBagCollection`` and ``EmbeddingCollection`` on embcore's engine.

Drop-in modules for a TorchRec model (docs/semantics.md section 15): built from TorchRec's own
``EmbeddingBagConfig`` / ``EmbeddingConfig``, a ``KeyedJaggedTensor`` in, a ``KeyedTensor`` out
(``EmbeddingCollection``: a dict of ``JaggedTensor``), and a ``state_dict`` in TorchRec's names
(``embedding_bags.<table>.weight``, ``embeddings.<table>.weight``), so that a TorchRec checkpoint
of an unsharded model loads. The tables are an ``ec.EmbeddingLayer``'s: the optimizer given as
TorchRec's ``fused_params`` (config/fused_params.py) or as an embcore optimizer updates the touched
rows inside ``loss.backward()``, as TorchRec's fused modules do; the model's torch optimizer
trains the dense part only. Given neither, the tables are plain ``nn.Parameter``s named as
TorchRec's unsharded module names them (``embedding_bags.<table>.weight``), and the model's torch
optimizer trains them (the layer's ``optimizer=None``).

Needs the ``torchrec`` extra; from a checkout of embcore: ``pip install -e ".[torchrec]"``, and on
a machine without CUDA ``pip install -e ".[torchrec]" ./packaging/fbgemm-gpu-cpu`` (FBGEMM's CPU
build; README, Quick start).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata
from typing import Any

import torch

try:
    from torchrec.modules.embedding_configs import DataType, PoolingType
    from torchrec.modules.embedding_modules import (
        EmbeddingBagCollectionInterface,
        EmbeddingCollectionInterface,
        get_embedding_names_by_table,
    )
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor
except ImportError as e:  # torchrec (with fbgemm_gpu) is an optional dependency
    raise ImportError(
        f"embcore.torchrec needs TorchRec, which is not installed ({e}). From a checkout of "
        f"embcore: pip install -e '.[torchrec]' (on a machine without CUDA: pip install -e "
        f"'.[torchrec]' ./packaging/fbgemm-gpu-cpu); from a built wheel: pip install "
        f"'embcore-<version>-py3-none-any.whl[torchrec]' (without CUDA, add the sdist's "
        f"packaging/fbgemm-gpu-cpu; README, Quick start)") from e
except OSError as e:  # FBGEMM's CUDA build without CUDA, or an FBGEMM built for another torch
    _fbgemm = sorted(f"{d.metadata['Name']} {d.version}" for d in metadata.distributions()
                     if str(d.metadata["Name"]).lower().replace("_", "-").startswith("fbgemm-gpu"))
    raise ImportError(
        f"embcore.torchrec: TorchRec is installed but its FBGEMM library does not load ({e}). "
        f"Installed: {', '.join(_fbgemm) or 'no FBGEMM'}, on torch {torch.__version__}. FBGEMM "
        f"must be built for this torch release (FBGEMM 1.9 for torch 2.14, 1.8 for torch 2.13) "
        f"and, on a machine without CUDA, be the CPU build fbgemm-gpu-cpu. From a checkout of "
        f"embcore: pip uninstall -y fbgemm-gpu fbgemm-gpu-cpu && pip install -e '.[torchrec]' "
        f"./packaging/fbgemm-gpu-cpu (torch 2.13: add fbgemm-gpu-cpu==1.8.0; README, Quick "
        f"start)") from e

from .config.fused_params import (
    DEFAULT_STOCHASTIC_ROUNDING,
    from_fused_params,
    stochastic_rounding,
)
from .config.tables import FeatureConfig, TableConfig
from .engine import EmbeddingTables
from .inputs.kjt import KeyedJagged, read_keyed_jagged
from .layer import EmbeddingLayer
from .numerics.rounding import clamp_fix, narrowed_for_load

_DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16,
           DataType.BF16: torch.bfloat16}
_COMBINERS = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "TorchRecTables"]


class _Weight(torch.nn.Module):
    """One table as a plain parameter, ``weight`` (N, D): TorchRec's unsharded module's
    ``nn.EmbeddingBag`` as far as its parameter, its name and its state go."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


def _unnamable(name: str) -> ValueError:
    return ValueError(f"table {name!r}: without an optimizer the tables are submodules named "
                      f"after them, and {name!r} cannot name one here (an attribute of the "
                      f"module, empty, or holding '.'); rename the table, or give fused_params "
                      f"/ optimizer=")


class TorchRecTables(EmbeddingLayer):
    """The ``ec.EmbeddingLayer`` under a TorchRec module, its state in TorchRec's names.

    Registered as the module's ``embedding_bags`` (``embeddings``), its ``state_dict`` holds
    ``<table>.weight`` per table, in the configs' order: TorchRec's keys. Optimizer slots are not
    in it (neither are they in TorchRec's module): ``ec.save(path, module.embedding_bags)`` saves
    them with the tables. Without an optimizer (``tables_are_parameters``) each table is the
    ``nn.Parameter`` ``<table>.weight`` (a submodule per table, as TorchRec's ``ModuleDict`` of
    ``nn.EmbeddingBag``), trained by the model's torch optimizer.
    """

    def __init__(self, feature_config: dict[str, FeatureConfig], optimizer: Any,
                 table_names: list[str], **kwargs: Any) -> None:
        for name in table_names if optimizer is None else ():
            if "." in name or not name:
                raise _unnamable(name)
        super().__init__(feature_config, optimizer, **kwargs)
        self.table_names = list(table_names)
        if self.tables_are_parameters:  # "<name>/parameters" -> the submodule "<name>".weight
            for name in self.table_names:
                weight = self._parameters.pop(f"{name}/parameters")
                assert isinstance(weight, torch.nn.Parameter)
                if (hasattr(type(self), name) or name in self.__dict__
                        or name in self._parameters or name in self._modules):
                    raise _unnamable(name)
                self.add_module(name, _Weight(weight))

    @property
    def embedding_tables(self) -> EmbeddingTables:
        """``{TableConfig: (N, D)}``: the ``<table>.weight`` parameters (without an optimizer)
        or the engine's tables; also read by a table's name."""
        if not self.tables_are_parameters:
            return self.engine.embedding_tables
        names = self.engine.table_names()
        return EmbeddingTables({t: self.get_submodule(n).weight for t, n in names.items()},
                               names)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        if self.tables_are_parameters:  # the submodules hold the tables: torch's own state
            torch.nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)
            return
        state = self.engine.state_dict()
        for name in self.table_names:
            value = state[f"{name}/parameters"]
            destination[f"{prefix}{name}.weight"] = value if keep_vars else value.detach()

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str,
                              local_metadata: Any, strict: bool, missing_keys: list[str],
                              unexpected_keys: list[str], error_msgs: list[str]) -> None:
        if self.tables_are_parameters:
            torch.nn.Module._load_from_state_dict(self, state_dict, prefix, local_metadata,
                                                  strict, missing_keys, unexpected_keys,
                                                  error_msgs)
            return
        own = self.engine.state_dict()
        wanted = {f"{prefix}{name}.weight": name for name in self.table_names}
        unexpected_keys += [k for k in state_dict if k.startswith(prefix) and k not in wanted]
        missing_keys += [k for k in wanted if k not in state_dict]
        values, errors_before = {}, len(error_msgs)
        for key, name in wanted.items():
            if key not in state_dict:
                continue
            value, shape = state_dict[key], tuple(own[f"{name}/parameters"].shape)
            if not isinstance(value, torch.Tensor):
                error_msgs.append(f'While copying the parameter named "{key}", expected a '
                                  f"tensor, got {type(value).__name__}")
            elif tuple(value.shape) != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(value.shape)} from checkpoint, the shape in current "
                                  f"model is {shape} (table {name!r})")
            else:
                dtype = own[f"{name}/parameters"].dtype
                try:  # a 16-bit table's rows given wider: narrowed as ec.load narrows them
                    values[f"{name}/parameters"] = narrowed_for_load(
                        value, dtype, f"{name}/parameters", f"load_state_dict ({key})",
                        "the state_dict", False, clamp_fix(dtype))
                except ValueError as e:
                    error_msgs.append(str(e))
        if len(error_msgs) > errors_before:
            return  # none of the tables loaded: torch raises with every message
        try:
            self.engine.load_state_dict(values, strict=False)
        except (KeyError, ValueError) as e:
            error_msgs.append(str(e))


class EmbeddingBagCollection(EmbeddingBagCollectionInterface):
    """TorchRec's ``EmbeddingBagCollection`` whose tables embcore holds and trains.

    Args:
        tables: TorchRec ``EmbeddingBagConfig``s: ``name``, ``num_embeddings``,
            ``embedding_dim``, ``feature_names`` (default ``[name]``), ``pooling`` (SUM or
            MEAN), ``data_type`` (FP32, FP16 or BF16), ``init_fn`` (TorchRec's default: uniform
            in ``+-sqrt(1 / num_embeddings)``).
        is_weighted: whether the input ``KeyedJaggedTensor``'s weights scale the ids (SUM
            pooling only, as TorchRec's own module).
        device: where the tables live (default the CPU).
        fused_params: the optimizer as TorchRec / FBGEMM users give it, e.g.
            ``{"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01}``
            (config/fused_params.py ``from_fused_params``); ``stochastic_rounding`` (a bool,
            default True as FBGEMM's) applies to FP16 / BF16 tables.
        optimizer: instead of ``fused_params``: anything ``ec.EmbeddingLayer`` takes
            (``ec.Adagrad(learning_rate=0.1)``, ``"adagrad"``, ``torch.optim.SGD``, ...).
            Neither given: as TorchRec's unsharded module, the tables are ``nn.Parameter``s
            (``embedding_bags.<table>.weight``) that the model's torch optimizer trains.
        **layer_kwargs: further arguments of ``ec.EmbeddingLayer`` (``memory_budget``,
            ``pipeline_execution``, ...).

    The output ``KeyedTensor``'s keys are TorchRec's: each feature's name, or
    ``feature@table`` for a feature several tables read; its values ``(B, sum of dims)``.

    Raises:
        ValueError: a config embcore cannot hold (duplicate table names, NONE pooling,
            weighted MEAN pooling, another data type, the meta device, without an optimizer a
            table name that cannot name a submodule), both ``fused_params`` and ``optimizer``,
            or ``fused_params`` that ``from_fused_params`` refuses.
        TypeError: ``fused_params`` that is not a dict, or of a value of the wrong type
            (``stochastic_rounding`` not a bool).
        ImportError: (on import) torchrec is not installed.

    Its forward raises ``ValueError`` / ``TypeError`` for a ``KeyedJaggedTensor`` TorchRec's
    checks refuse (inputs/kjt.py), lacking a feature, or without weights when weighted.
    """

    def __init__(self, tables: list[Any], is_weighted: bool = False,
                 device: torch.device | str | None = None, *,
                 fused_params: Mapping[str, Any] | None = None, optimizer: Any = None,
                 **layer_kwargs: Any) -> None:
        super().__init__()
        self._is_weighted = bool(is_weighted)
        self._embedding_bag_configs = tables
        for config in tables:
            if config.pooling not in _COMBINERS:
                raise ValueError(f"table {config.name!r}: pooling {config.pooling} is not "
                                 f"supported by an EmbeddingBagCollection; use SUM or MEAN (or "
                                 f"EmbeddingCollection for unpooled embeddings)")
            if self._is_weighted and config.pooling != PoolingType.SUM:
                raise ValueError(f"table {config.name!r}: weighted {config.pooling} pooling is "
                                 f"not supported (TorchRec's EmbeddingBagCollection refuses "
                                 f"it too: torch.nn.EmbeddingBag takes per_sample_weights with "
                                 f"mode='sum' only); use PoolingType.SUM")
        self._features, self._names, self._device = _features(
            tables, "EmbeddingBagCollection", device, fused_params,
            lambda c: _COMBINERS[c.pooling])
        self._lengths_per_embedding = [c.embedding_dim for c in tables
                                       for _ in c.feature_names]
        self.embedding_bags = TorchRecTables(
            {name: feature for name, (feature, _) in self._features.items()},
            _optimizer(fused_params, optimizer), [c.name for c in tables],
            device=self._device, **layer_kwargs)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """The pooled embeddings of ``features`` (a ``KeyedJaggedTensor``): ``(B, sum of
        dims)``, a ``KeyedTensor`` keyed as TorchRec's module keys it."""
        ids, weights = _inputs(features, self._features, self._is_weighted)
        out = self.embedding_bags(ids, weights)
        return KeyedTensor(keys=self._names, length_per_key=self._lengths_per_embedding,
                           values=torch.cat([out[name] for name in self._names], dim=1))

    def is_weighted(self) -> bool:
        """Whether the input's weights scale the ids."""
        return self._is_weighted

    def embedding_bag_configs(self) -> list[Any]:
        """The ``EmbeddingBagConfig``s this module was built from."""
        return self._embedding_bag_configs

    @property
    def device(self) -> torch.device:
        """Where the tables live."""
        return self._device


class EmbeddingCollection(EmbeddingCollectionInterface):
    """TorchRec's ``EmbeddingCollection`` (unpooled, sequence embeddings) on embcore's tables.

    Args:
        tables: TorchRec ``EmbeddingConfig``s, all of one ``embedding_dim`` (as TorchRec
            requires).
        device: where the tables live (default the CPU).
        need_indices: also return each feature's ids as its ``JaggedTensor``'s weights.

    fused_params, optimizer and the other keyword args are those of ``EmbeddingBagCollection``.

    The output maps each feature's name (``feature@table`` for a feature several tables read)
    to a ``JaggedTensor``: one ``(D,)`` row per id, ``(number of ids, D)``, with the input's
    lengths. The input's weights are not used (neither does TorchRec's module use them).
    """

    def __init__(self, tables: list[Any], device: torch.device | str | None = None,
                 need_indices: bool = False, *, fused_params: Mapping[str, Any] | None = None,
                 optimizer: Any = None, **layer_kwargs: Any) -> None:
        super().__init__()
        dims = sorted({c.embedding_dim for c in tables})
        if len(dims) > 1:
            raise ValueError(f"EmbeddingCollection: all tables must have one embedding_dim (as "
                             f"TorchRec's), got {dims}")
        self._embedding_configs = tables
        self._need_indices = bool(need_indices)
        self._embedding_dim = dims[0] if dims else -1
        self._features, self._names, self._device = _features(
            tables, "EmbeddingCollection", device, fused_params, lambda c: "sum")
        self._names_by_table = get_embedding_names_by_table(tables)
        self.embeddings = TorchRecTables(
            {name: feature for name, (feature, _) in self._features.items()},
            _optimizer(fused_params, optimizer), [c.name for c in tables],
            device=self._device, **layer_kwargs)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Each feature's embeddings, one row per id, as a ``JaggedTensor`` with the input's
        lengths."""
        per_key = _sequences(features, self._features)
        out = self.embeddings({name: per_key[key][0]
                               for name, (_, key) in self._features.items()})
        return {name: JaggedTensor(values=out[name], lengths=per_key[key][1],
                                   weights=per_key[key][0] if self._need_indices else None)
                for name, (_, key) in self._features.items()}

    def need_indices(self) -> bool:
        """Whether the output carries the ids as its weights."""
        return self._need_indices

    def embedding_dim(self) -> int:
        """The tables' common embedding dim."""
        return self._embedding_dim

    def embedding_configs(self) -> list[Any]:
        """The ``EmbeddingConfig``s this module was built from."""
        return self._embedding_configs

    def embedding_names_by_table(self) -> list[list[str]]:
        """Per table, the output names of its features."""
        return self._names_by_table

    @property
    def device(self) -> torch.device:
        """Where the tables live."""
        return self._device


def _optimizer(fused_params: Mapping[str, Any] | None, optimizer: Any) -> Any:
    if fused_params is not None and optimizer is not None:
        raise ValueError("give fused_params or optimizer, not both")
    if fused_params is None and optimizer is None:
        return None  # the tables are nn.Parameters, as TorchRec's unsharded module's
    return from_fused_params(fused_params) if fused_params is not None else optimizer


def _features(tables: list[Any], what: str, device: torch.device | str | None,
              fused_params: Mapping[str, Any] | None, combiner: Any
              ) -> tuple[dict[str, tuple[FeatureConfig, str]], list[str], torch.device]:
    """``({output name: (FeatureConfig, input key)}, output names in order, device)``."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "meta":
        raise ValueError(f"{what}: embcore builds its tables at construction; the meta device "
                         f"(TorchRec's sharding planner's) is not supported")
    seen: set[str] = set()
    for config in tables:
        if config.name in seen:
            raise ValueError(f"{what}: duplicate table name {config.name!r}")
        seen.add(config.name)
        if config.data_type not in _DTYPES:
            raise ValueError(f"table {config.name!r}: data_type {config.data_type} is not "
                             f"supported; use FP32, FP16 or BF16")
        if not config.feature_names:
            config.feature_names = [config.name]  # (what TorchRec's modules do)
    rounding = (stochastic_rounding(fused_params) if fused_params is not None
                else DEFAULT_STOCHASTIC_ROUNDING)
    features: dict[str, tuple[FeatureConfig, str]] = {}
    for config, names in zip(tables, get_embedding_names_by_table(tables)):
        table = TableConfig(vocabulary_size=config.num_embeddings, dim=config.embedding_dim,
                            name=config.name, combiner=combiner(config),
                            initializer=config.init_fn, dtype=_DTYPES[config.data_type],
                            stochastic_rounding=rounding)
        for key, name in zip(config.feature_names, names):
            features[name] = (FeatureConfig(table=table, name=name), key)
    return features, list(features), device


def _read(features: Any, wanted: dict[str, tuple[FeatureConfig, str]]) -> KeyedJagged:
    """The input ``KeyedJaggedTensor``, checked as TorchRec checks it (inputs/kjt.py) and
    holding every key the modules read."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"expected a torchrec KeyedJaggedTensor, got {type(features).__name__}")
    kj = read_keyed_jagged(features)
    kj.require({key for _, key in wanted.values()}, exact=False)
    return kj


def _inputs(features: Any, wanted: dict[str, tuple[FeatureConfig, str]], weighted: bool
            ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``({name: ids}, {name: weights} or None)`` in embcore's forms (docs/semantics.md section
    1): each key's bags as a jagged ``(values, offsets)`` pair (its weights likewise); or, when
    every bag of the batch holds one id and no weights apply, each key's ids as dense ids
    ``(B,)``: a bag of one id is that id's row whatever the pooling, and dense one-id batches
    take the engine's native preprocess."""
    kj = _read(features, wanted)
    if not weighted and kj.one_id_per_bag:
        return {name: kj.dense(key) for name, (_, key) in wanted.items()}, None
    if weighted and kj.weights is None:
        raise ValueError(f"the module is weighted (is_weighted=True) but the KeyedJaggedTensor "
                         f"has no weights (features {sorted(kj.keys)})")
    ids, weights = {}, {}
    for name, (_, key) in wanted.items():
        ids[name] = kj.ids(key)
        if weighted:
            weights[name] = (kj.weights_of(key), ids[name][1])
    return ids, (weights if weighted else None)


def _sequences(features: Any, wanted: dict[str, tuple[FeatureConfig, str]]
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each key's ``(ids, lengths)``: its values (looked up one by one) and bag lengths."""
    kj = _read(features, wanted)
    return {key: (kj.ids(key)[0], kj.lengths(key)) for key in {k for _, k in wanted.values()}}
