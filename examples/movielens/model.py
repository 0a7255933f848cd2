"""The ranking model of the MovieLens example: embcore tables for users and movies plus an MLP.

    user_id  (B,) -> users table  (2048 x 64) --\
                                                  concat (B, 128) -> dropout -> MLP 256-64-1
    movie_id (B,) -> movies table (2048 x 64) --/                                  -> rating (B,)

The tables live in an ``ec.EmbeddingLayer``: its forward looks the ids up, and ``loss.backward()``
makes the engine apply its sparse optimizer (Adagrad by default) to the touched rows, in place. The
layer has no ``nn.Parameter``s in that mode, so the dense optimizer sees only the MLP's weights.

``ServingModel`` is the same computation with the tables frozen into a plain-torch module
(``layer.for_serving()``): it is what ``torch.export`` saves for serving.

With ``ModelConfig(raw_ids=True)`` both tables are dynamic (``ec.DynamicVocabulary``): they take
raw int64 ids of any value, and their vocabulary sizes are capacities (the most ids resident at
once; a training step admits new ids and evicts the lowest-scored). Nothing else changes: the
forward, the loss and the serving model are the same code.

With ``ModelConfig(dtype="float16")`` (or ``"bfloat16"``) the tables hold compact rows: 16 bits an
entry, widened to float32 on lookup (the activations, the MLP and the loss stay float32), each
update computed in float32 and rounded back, stochastically unless ``stochastic_rounding=False``
(to nearest). A checkpoint keeps the rows' dtype, and so does the serving model.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import embcore as ec

USER_TABLE, MOVIE_TABLE = "users", "movies"  # table names: checkpoint keys are "users/parameters"
FEATURES = ("user_id", "movie_id")
# The tables' row dtypes (ModelConfig.dtype, the job's --dtype): float32, or 16-bit compact rows.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to rebuild the model (saved in every checkpoint, in dense.pt)."""

    user_vocabulary_size: int = 2048
    movie_vocabulary_size: int = 2048
    embedding_dim: int = 64
    hidden: tuple[int, ...] = (256, 64)
    dropout: float = 0.5  # on the concatenated activations, in training only
    raw_ids: bool = False  # dynamic tables: raw int64 ids, vocabulary sizes are capacities
    eviction: str = "lru"  # raw ids: "lru" or "lfu" (ec.DynamicVocabulary)
    admit_after: int = 1  # raw ids: training steps an id is seen in before it gets a row
    min_rating: float = 1.0  # predictions are clamped to [min_rating, max_rating] in eval mode
    max_rating: float = 5.0
    dtype: str = "float32"  # the tables' rows: a key of DTYPES ("float16", "bfloat16": compact)
    stochastic_rounding: bool = True  # compact rows: updates rounded stochastically (else
    #                                   to nearest)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


def feature_config(config: ModelConfig) -> dict[str, ec.FeatureConfig]:
    """The two features and their tables, as the tutorial declares them (dynamic: raw ids;
    ``config.dtype``: the rows' dtype)."""
    dynamic = (ec.DynamicVocabulary(eviction=config.eviction, admit_after=config.admit_after)
               if config.raw_ids else None)
    rows = {"dtype": DTYPES[config.dtype], "stochastic_rounding": config.stochastic_rounding}
    users = ec.TableConfig(vocabulary_size=config.user_vocabulary_size,
                           dim=config.embedding_dim, name=USER_TABLE, dynamic=dynamic, **rows)
    movies = ec.TableConfig(vocabulary_size=config.movie_vocabulary_size,
                            dim=config.embedding_dim, name=MOVIE_TABLE, dynamic=dynamic, **rows)
    return {"user_id": ec.FeatureConfig(table=users, name="user_id"),
            "movie_id": ec.FeatureConfig(table=movies, name="movie_id")}


class RatingHead(nn.Module):
    """The dense part: dropout, an MLP with ReLU, and one output, the predicted rating.

    In eval mode the prediction is clamped to the rating scale (ratings are 1 to 5 stars); in
    training it is not, so that every example keeps its gradient.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        widths = [2 * config.embedding_dim, *config.hidden]
        layers: list[nn.Module] = [nn.Dropout(config.dropout)]
        for w_in, w_out in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(w_in, w_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], 1))
        self.mlp = nn.Sequential(*layers)
        self.min_rating, self.max_rating = config.min_rating, config.max_rating

    def init_output_bias(self, mean_rating: float) -> None:
        """Starts the output at the mean rating: the MLP then learns the deviations from it."""
        with torch.no_grad():
            self.mlp[-1].bias.fill_(mean_rating)

    def forward(self, user: torch.Tensor, movie: torch.Tensor) -> torch.Tensor:
        x = torch.cat([user, movie], dim=1)  # (B, 2D)
        rating = self.mlp(x).squeeze(-1)  # (B,)
        if not self.training:
            rating = rating.clamp(self.min_rating, self.max_rating)
        return rating


class RankingModel(nn.Module):
    """Predicts a user's rating of a movie.

    Args:
        config: sizes and regularization.
        embedding_optimizer: the engine's optimizer for the tables (e.g. ``ec.Adagrad(0.1)``), or
            None for a model that is only restored and served: its tables are then plain
            ``nn.Parameter``s, with no optimizer slots (not with ``raw_ids``: dynamic tables
            need the engine's optimizer step, which admits and evicts ids).
        device: where the tables live (the MLP is moved there too).
        sharding, exchange_compression: those of ``ec.EmbeddingLayer`` (several processes).
    """

    def __init__(self, config: ModelConfig, embedding_optimizer: Any = None, *,
                 device: torch.device | str | None = None, sharding: Any = None,
                 exchange_compression: Any = None) -> None:
        super().__init__()
        self.config = config
        self.feature_config = feature_config(config)
        self.embedding = ec.EmbeddingLayer(self.feature_config, embedding_optimizer,
                                           device=device, sharding=sharding,
                                           exchange_compression=exchange_compression)
        self.head = RatingHead(config).to(device)

    def forward(self, features: Mapping[str, torch.Tensor],
                serving_config: Mapping[str, ec.FeatureConfig] | None = None) -> torch.Tensor:
        """``features``: ``{"user_id": (B,), "movie_id": (B,)}`` int64 ids -> ratings (B,)."""
        acts = self.embedding({k: features[k] for k in FEATURES},
                              serving_config=serving_config)  # {feature: (B, D)}
        return self.head(acts["user_id"], acts["movie_id"])

    def compute_loss(self, features: Mapping[str, torch.Tensor], rating: torch.Tensor,
                     l2: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The training objective of one batch and its squared errors.

        The objective is summed over the batch, not averaged: each example then pushes its own
        table rows with a gradient of the same size whatever the batch size, which keeps the
        engine's Adagrad in its working range (averaged, the gradients of a 1024 batch would be
        so small that the initial accumulator value 0.1 dominates and the rows barely move).
        The dense optimizer (Adam) does not care about the scale. ``l2`` penalizes the squared
        norm of every looked-up row once per occurrence: classic matrix-factorization
        regularization, so rows of frequent ids are held back as much as their data allows.

        Returns:
            (objective, a scalar to call ``backward()`` on; squared errors (B,), detached).
        """
        acts = self.embedding({k: features[k] for k in FEATURES})  # {feature: (B, D)}
        user, movie = acts["user_id"], acts["movie_id"]
        squared_error = (self.head(user, movie) - rating).square()  # (B,)
        objective = squared_error.sum()
        if l2 > 0:
            objective = objective + l2 * (user.square().sum() + movie.square().sum())
        return objective, squared_error.detach()


class ServingModel(nn.Module):
    """A trained ``RankingModel`` as plain torch ops, for ``torch.export``.

    The tables are a snapshot taken by ``layer.for_serving()`` (parameters only, no optimizer
    slots, no engine; a dynamic table with its map); the head is a copy, in eval mode. Inputs are
    two id tensors of shape (B,) (raw ids for a ``raw_ids`` model).
    """

    def __init__(self, model: RankingModel) -> None:
        super().__init__()
        self.embedding = model.embedding.for_serving()
        self.head = copy.deepcopy(model.head).eval()

    def forward(self, user_id: torch.Tensor, movie_id: torch.Tensor) -> torch.Tensor:
        acts = self.embedding({"user_id": user_id, "movie_id": movie_id})  # {feature: (B, D)}
        return self.head(acts["user_id"], acts["movie_id"])  # (B,)


def as_model_config(values: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from its JSON / checkpoint form (where ``hidden`` became a list)."""
    return ModelConfig(**{**values, "hidden": tuple(values["hidden"])})
