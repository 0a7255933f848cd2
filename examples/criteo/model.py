"""DLRM-DCNv2 (the MLPerf Training recommendation benchmark's model) on embcore tables.

    I1..I13 (B, 13) -> bottom MLP 512-256-128, ReLU --------------------------\\
    C1 (B,) -> table C1 (D) -\\                                                 concat (B, 128 + 26 D)
    ...                        26 embeddings (B, D) each --------------------/
    C26 (B,) -> table C26 (D) -/
        -> 3 low-rank cross layers (DCN v2, rank 512): x_{l+1} = x0 * (U_l (V_l^T x_l) + b_l) + x_l
        -> top MLP 1024-1024-512-256, ReLU -> 1 logit

Every size is a ``ModelConfig`` field (the job's flags), so tests build tiny ones. The 26 tables
live in one ``ec.EmbeddingLayer`` built from an ``ec.EmbeddingSpec``: the one ``embedding_spec``
makes of a ``ModelConfig``, or one read from a JSON file (``check_spec`` says whether it fits
this model: features C1 ... C26, one id each, every table of one dim D, an optimizer for every
table). The engine applies its sparse optimizer to the touched rows during ``loss.backward()``
and the layer has no ``nn.Parameter`` then, so the dense optimizer sees only the MLPs and cross
layers.

Tables: with ``raw_ids`` (the default) each table is dynamic (``ec.DynamicVocabulary``): it takes
the raw 32-bit hashes (missing: -1) and holds ``capacities[j]`` of them at once, evicting the least
recently used beyond that. Otherwise the ids are already hashed (``id % buckets``) and each table
has ``capacities[j]`` = its bucket count of rows. The rows are float32, or with
``dtype=torch.float16`` / ``torch.bfloat16`` (the job's ``--dtype``) compact 16-bit rows: widened
to float32 on lookup, each update computed in float32 and rounded back (stochastically unless
``stochastic_rounding`` is False). The dtype is the spec's (each table's ``"dtype"``), not a
``ModelConfig`` field: the dense part is the same whatever the rows.

Optimizers, as MLPerf's reference (TorchRec's DLRM-DCNv2 training script with ``--adagrad``):
Adagrad with learning rate 0.005 for both the tables and the dense part, the accumulators
starting at 0 (torch's ``Adagrad`` default; embcore's Adagrad defaults to TF's 0.1, so the job
passes 0). The reference trains the tables with FBGEMM's *row-wise* Adagrad (one accumulator per
row) to save memory; ``embedding_optimizer="rowwise_adagrad"`` (``ec.RowwiseAdagrad``) is that
choice, plain Adagrad (one accumulator per entry) the default asked for here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import embcore as ec

NUM_DENSE, NUM_SPARSE = 13, 26
ARCHS = ("dcnv2", "logreg")
FEATURES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))  # feature j uses table "C{j+1}"


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to rebuild the model (saved in checkpoints)."""

    capacities: tuple[int, ...]  # (26,) rows per table (dynamic: ids resident at once)
    dim: int = 128  # D of every table
    bottom: tuple[int, ...] = (512, 256, 128)  # bottom MLP widths (ReLU after each)
    cross_layers: int = 3
    cross_rank: int = 512  # rank of each low-rank cross layer
    top: tuple[int, ...] = (1024, 1024, 512, 256)  # top MLP hidden widths (then 1 logit)
    raw_ids: bool = True  # dynamic tables taking raw ids; else static, pre-hashed ids
    eviction: str = "lru"
    arch: str = "dcnv2"  # "dcnv2": DLRM-DCNv2; "logreg": logistic regression (D 1, no MLPs)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.arch == "logreg" and self.dim != 1:
            raise ValueError(f"a logistic regression has one weight per category value: its "
                             f"tables have dim 1, got {self.dim}")
        if len(self.capacities) != NUM_SPARSE or min(self.capacities) < 1:
            raise ValueError(f"capacities must be 26 sizes >= 1, got {self.capacities}")
        for name in ("dim", "cross_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cross_layers < 0 or not self.bottom or min(self.bottom + self.top, default=1) < 1:
            raise ValueError(f"bad model sizes: bottom {self.bottom}, top {self.top}, "
                             f"cross_layers {self.cross_layers}")

    @property
    def interaction_width(self) -> int:
        """Width of the cross layers' input: the bottom MLP's output and 26 embeddings."""
        return self.bottom[-1] + NUM_SPARSE * self.dim


def as_model_config(values: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from its JSON / checkpoint form (tuples became lists)."""
    return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def feature_config(config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                   stochastic_rounding: bool = True) -> dict[str, ec.FeatureConfig]:
    """26 features, each with its own table named like the feature (C1 ... C26), its rows of
    ``dtype`` (float16 / bfloat16: compact, updates rounded as ``stochastic_rounding`` says)."""
    dynamic = ec.DynamicVocabulary(eviction=config.eviction) if config.raw_ids else None
    # a logistic regression's weights start at 0 (as its dense part's would in a GLM solver)
    init = functools.partial(torch.nn.init.zeros_) if config.arch == "logreg" else None
    return {name: ec.FeatureConfig(
        table=ec.TableConfig(vocabulary_size=cap, dim=config.dim, name=name, dynamic=dynamic,
                             initializer=init, dtype=dtype,
                             stochastic_rounding=stochastic_rounding),
        name=name) for name, cap in zip(FEATURES, config.capacities, strict=True)}


def embedding_spec(config: ModelConfig, optimizer: Any, *, sharding: Any = None,
                   memory_budget: Any = None, dtype: torch.dtype = torch.float32,
                   stochastic_rounding: bool = True,
                   exchange_compression: Any = None) -> ec.EmbeddingSpec:
    """The tables ``config`` describes, with the tables' ``optimizer`` and rows of ``dtype``,
    as an EmbeddingSpec."""
    features = feature_config(config, dtype=dtype, stochastic_rounding=stochastic_rounding)
    return ec.EmbeddingSpec(features, optimizer, sharding=sharding,
                            memory_budget=memory_budget,
                            exchange_compression=exchange_compression)


def spec_tables(spec: ec.EmbeddingSpec) -> dict[str, ec.TableConfig]:
    """Each feature's table, C1 ... C26 in order, once the spec is checked to fit the model.

    Raises:
        ValueError: the features are not C1 ... C26 (naming the missing and unexpected ones),
            one takes more than one id per example, the tables' dims differ (the cross layers
            need one D) or a table has no optimizer.
    """
    features = spec.feature_config
    if not isinstance(features, Mapping):
        raise ValueError(f"the spec's features must be a dict of the 26 features C1 ... C26, "
                         f"got a {type(features).__name__}")
    missing = [f for f in FEATURES if f not in features]
    extra = sorted(set(features) - set(FEATURES))
    if missing or extra:
        raise ValueError("the spec's features must be C1 ... C26 (the Criteo columns): "
                         + "; ".join(([f"missing {missing}"] if missing else [])
                                     + ([f"unexpected {extra}"] if extra else [])))
    tables = {}
    for name in FEATURES:
        f = features[name]
        if not isinstance(f, ec.FeatureConfig):
            raise ValueError(f"feature {name!r} of the spec is a {type(f).__name__}, not a "
                             f"feature")
        if f.max_sequence_length or f.output_shape is not None:
            raise ValueError(f"feature {name!r}: the job looks up one id per example; its "
                             f"max_sequence_length must be 0 and output_shape None, got "
                             f"{f.max_sequence_length} and {f.output_shape}")
        if f.table.optimizer is None and spec.optimizer is None:
            raise ValueError(f"feature {name!r}: its table has no optimizer and the spec has no "
                             f"default one, so it would not train; give the spec an optimizer")
        tables[name] = f.table
    dims: dict[int, list[str]] = {}
    for name, t in tables.items():
        dims.setdefault(t.dim, []).append(name)
    if len(dims) > 1:
        raise ValueError("the cross layers need one dim D for all 26 tables; the spec has "
                         + "; ".join(f"dim {d}: {', '.join(n)}" for d, n in dims.items()))
    return tables


def config_from_spec(spec: ec.EmbeddingSpec, **dense: Any) -> ModelConfig:
    """The ModelConfig of a model whose tables are ``spec``'s (``dense``: the other sizes):
    D, the rows of each feature's table and whether all are dynamic (raw ids) or none.

    Raises:
        ValueError: the spec does not fit (``spec_tables``), or mixes dynamic tables with
            static ones (the reader hashes all 26 features or none).
    """
    tables = spec_tables(spec)
    dynamic = [n for n, t in tables.items() if t.dynamic is not None]
    if dynamic and len(dynamic) < NUM_SPARSE:
        static = [n for n in FEATURES if n not in dynamic]
        raise ValueError(f"the spec mixes dynamic tables (raw ids: {', '.join(dynamic)}) with "
                         f"static ones (hashed ids: {', '.join(static)}); the reader hashes all "
                         f"features or none, so make all 26 dynamic or all static")
    first = tables[FEATURES[0]]
    return ModelConfig(capacities=tuple(t.vocabulary_size for t in tables.values()),
                       dim=first.dim, raw_ids=bool(dynamic),
                       eviction=first.dynamic.eviction if dynamic else "lru", **dense)


def mlp(widths: list[int], final_relu: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (w_in, w_out) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(w_in, w_out))
        if final_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class LowRankCross(nn.Module):
    """DCN v2's cross network with low-rank weights: ``x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l``
    (``V_l``: width -> rank without bias, ``U_l``: rank -> width with bias ``b_l``)."""

    def __init__(self, width: int, layers: int, rank: int) -> None:
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(width, rank, bias=False) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(rank, width) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0  # (B, W)
        for down, up in zip(self.down, self.up, strict=True):
            x = x0 * up(down(x)) + x  # (B, W)
        return x


class DenseArch(nn.Module):
    """Everything but the tables: bottom MLP, cross layers, top MLP (data parallel under
    torchrun)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.bottom = mlp([NUM_DENSE, *config.bottom])
        self.cross = LowRankCross(config.interaction_width, config.cross_layers,
                                  config.cross_rank)
        self.top = mlp([config.interaction_width, *config.top, 1], final_relu=False)

    def forward(self, dense: torch.Tensor, embeddings: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat([self.bottom(dense), *embeddings], dim=1)  # (B, bottom[-1] + 26 D)
        return self.top(self.cross(x)).squeeze(-1)  # (B,) logits


class LinearArch(nn.Module):
    """The baseline's dense part: a logistic regression's logit, ``w . dense + b`` plus the 26
    looked-up weights (tables of dim 1: one weight per category value)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(NUM_DENSE, 1)
        nn.init.zeros_(self.dense.weight)
        nn.init.zeros_(self.dense.bias)

    def forward(self, dense: torch.Tensor, embeddings: list[torch.Tensor]) -> torch.Tensor:
        return self.dense(dense).squeeze(-1) + torch.cat(embeddings, dim=1).sum(dim=1)  # (B,)


def make_dense_arch(config: ModelConfig) -> nn.Module:
    """The part of the model after the tables: ``DenseArch`` (DCN v2) or ``LinearArch``."""
    return DenseArch(config) if config.arch == "dcnv2" else LinearArch()


class DLRM(nn.Module):
    """DLRM-DCNv2: ``forward(dense (B, 13) float, sparse (B, 26) int64) -> logits (B,)``.

    Args:
        config: the sizes; ``arch="logreg"`` makes the baseline instead, a logistic regression
            (``LinearArch`` after tables of dim 1).
        embedding_optimizer: the engine's optimizer for the tables (e.g. ``ec.Adagrad``).
        spec: instead of ``embedding_optimizer``, ``sharding`` and ``memory_budget``: the tables
            as an ``ec.EmbeddingSpec`` (``config_from_spec(spec, ...)`` gives its config).
        device, sharding: where the tables live and how they are split under torchrun.
        memory_budget, offload_dir: tables beyond memory (``ec.Embedding``'s): the tables that
            do not fit go to files under ``offload_dir`` with their hot rows cached (static
            tables: dynamic ones stay in fast memory).

    Raises:
        ValueError: a spec that does not fit the model or ``config`` (its dim or rows).
    """

    def __init__(self, config: ModelConfig, embedding_optimizer: Any = None, *,
                 spec: ec.EmbeddingSpec | None = None,
                 device: torch.device | str | None = None, sharding: Any = None,
                 memory_budget: Any = None, offload_dir: Any = None) -> None:
        super().__init__()
        if spec is None:
            spec = embedding_spec(config, embedding_optimizer, sharding=sharding,
                                  memory_budget=memory_budget)
        elif (embedding_optimizer, sharding, memory_budget) != (None, None, None):
            raise TypeError("DLRM: the spec holds the tables' optimizer, sharding and memory "
                            "budget; pass it alone")
        tables = spec_tables(spec)
        rows = tuple(t.vocabulary_size for t in tables.values())
        if (tables[FEATURES[0]].dim, rows) != (config.dim, config.capacities):
            raise ValueError(f"the spec's tables (dim {tables[FEATURES[0]].dim}, rows {rows}) "
                             f"are not the config's (dim {config.dim}, rows "
                             f"{config.capacities})")
        self.config, self.spec = config, spec
        self.embedding = ec.EmbeddingLayer.from_spec(spec, device=device,
                                                     offload_dir=offload_dir)
        self.dense_arch = make_dense_arch(config).to(device)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        acts = self.embedding({name: sparse[:, j]
                               for j, name in enumerate(FEATURES)})  # {feature: (B, D)}
        return self.dense_arch(dense, [acts[name] for name in FEATURES])  # (B,)
