"""DLRM-DCNv2 (the MLPerf Training recommendation benchmark's model) on embcore tables.

    I1..I13 (B, 13) -> bottom MLP 512-256-128, ReLU --------------------------\\
    C1 (B,) -> table C1 (D) -\\                                                 concat (B, 128 + 26 D)
    ...                        26 embeddings (B, D) each --------------------/
    C26 (B,) -> table C26 (D) -/
        -> 3 low-rank cross layers (DCN v2, rank 512): x_{l+1} = x0 * (U_l (V_l^T x_l) + b_l) + x_l
        -> top MLP 1024-1024-512-256, ReLU -> 1 logit

Every size is a ``ModelConfig`` field (the job's flags), so tests build tiny ones. The 26 tables
live in one ``ec.EmbeddingLayer``; the engine applies its sparse optimizer to the touched rows
during ``loss.backward()`` and the layer has no ``nn.Parameter`` then, so the dense optimizer sees
only the MLPs and cross layers.

Tables: with ``raw_ids`` (the default) each table is dynamic (``ec.DynamicVocabulary``): it takes
the raw 32-bit hashes (missing: -1) and holds ``capacities[j]`` of them at once, evicting the least
recently used beyond that. Otherwise the ids are already hashed (``id % buckets``) and each table
has ``capacities[j]`` = its bucket count of rows.

Optimizers, as MLPerf's reference (TorchRec's DLRM-DCNv2 training script with ``--adagrad``):
Adagrad with learning rate 0.005 for both the tables and the dense part, the accumulators
starting at 0 (torch's ``Adagrad`` default; embcore's Adagrad defaults to TF's 0.1, so the job
passes 0). The reference trains the tables with FBGEMM's *row-wise* Adagrad (one accumulator per
row) to save memory; ``embedding_optimizer="rowwise_adagrad"`` (``ec.RowwiseAdagrad``) is that
choice, plain Adagrad (one accumulator per entry) the default asked for here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import embcore as ec

NUM_DENSE, NUM_SPARSE = 13, 26
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

    def __post_init__(self) -> None:
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


def feature_config(config: ModelConfig) -> dict[str, ec.FeatureConfig]:
    """26 features, each with its own table named like the feature (C1 ... C26)."""
    dynamic = ec.DynamicVocabulary(eviction=config.eviction) if config.raw_ids else None
    return {name: ec.FeatureConfig(
        table=ec.TableConfig(vocabulary_size=cap, dim=config.dim, name=name, dynamic=dynamic),
        name=name) for name, cap in zip(FEATURES, config.capacities, strict=True)}


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


class DLRM(nn.Module):
    """DLRM-DCNv2: ``forward(dense (B, 13) float, sparse (B, 26) int64) -> logits (B,)``.

    Args:
        config: the sizes.
        embedding_optimizer: the engine's optimizer for the tables (e.g. ``ec.Adagrad``).
        device, sharding: where the tables live and how they are split under torchrun.
        memory_budget, offload_dir: tables beyond memory (``ec.Embedding``'s): the tables that
            do not fit go to files under ``offload_dir`` with their hot rows cached (static
            tables: dynamic ones stay in fast memory).
    """

    def __init__(self, config: ModelConfig, embedding_optimizer: Any, *,
                 device: torch.device | str | None = None, sharding: Any = None,
                 memory_budget: Any = None, offload_dir: Any = None) -> None:
        super().__init__()
        self.config = config
        self.embedding = ec.EmbeddingLayer(feature_config(config), embedding_optimizer,
                                           device=device, sharding=sharding,
                                           memory_budget=memory_budget, offload_dir=offload_dir)
        self.dense_arch = DenseArch(config).to(device)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        acts = self.embedding({name: sparse[:, j]
                               for j, name in enumerate(FEATURES)})  # {feature: (B, D)}
        return self.dense_arch(dense, [acts[name] for name in FEATURES])  # (B,)
