"""Lookup statistics (TF's ``profile_data_directory``): how often each table's ids are looked up.

``ec.profile(batches, feature_config)`` runs sample batches through the features' input rules
(no tables, no optimizer) and records, per table, the ids looked up per batch and the **curve**:
the share of lookups that its k most frequent ids take, at k = 1, 2, 4, ... (a few dozen points,
so the file stays small whatever the table's size). ``Embedding(profile=...)`` passes it to the
planner: measured lookups weigh the tables (cache sizes, and the owners of whole tables when
sharded), and the curves size the caches of tables beyond ``memory_budget`` (tiers.py).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..inputs.features import Features, Shapes
from ..ops.backend import host
from .plan import ShardingPlan, make_plan
from .tiers import Curve, profile_curve

FORMAT = "embcore-profile-1"


@dataclass(frozen=True)
class TableProfile:
    """One table's statistics: mean ids per batch, distinct ids seen, ``(k, share)`` points."""

    lookups_per_batch: float
    distinct: int
    points: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class LookupProfile:
    """Per-table lookup statistics from ``batches`` sample batches (``ec.profile``).

    Checked when made (by ``ec.profile``, ``load``, ``from_dict`` or by hand): ``batches`` and
    each table's ``distinct`` are integers >= 0, ``lookups_per_batch`` a finite number >= 0, and
    its points ``(k, share)`` rise in k (integers, 1 <= k <= ``distinct``) and in share (finite,
    0..1). Raises ValueError naming the table and the field, TypeError for another type."""

    batches: int
    tables: Mapping[str, TableProfile] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if type(self.batches) is not int or self.batches < 0:
            raise ValueError(f"profile: batches is {self.batches!r}; it must be an integer "
                             f">= 0 (the sample batches counted)")
        if not isinstance(self.tables, Mapping):
            raise TypeError(f"profile: tables must be a mapping of table name to "
                            f"TableProfile, got {type(self.tables).__name__}")
        for n, t in self.tables.items():
            _check_table(n, t)

    def curve(self, table: str, rows: int) -> Curve | None:
        """The table's curve over its ``rows`` rows, or None when it was not profiled."""
        t = self.tables.get(table)
        return None if t is None else profile_curve(t.points, max(rows, t.distinct))

    def lookups(self) -> dict[str, float]:
        return {n: t.lookups_per_batch for n, t in self.tables.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "batches": self.batches,
                "tables": {n: {"lookups_per_batch": t.lookups_per_batch,
                               "distinct": t.distinct, "points": [list(p) for p in t.points]}
                           for n, t in self.tables.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LookupProfile:
        """Raises ValueError for anything but a profile written by ``to_dict``/``save``."""
        try:
            if d.get("format") != FORMAT:
                raise ValueError(f"not an embcore profile (format {d.get('format')!r})")
            tables = {str(n): TableProfile(float(t["lookups_per_batch"]), _integer(t["distinct"]),
                                           tuple((_integer(k), float(v)) for k, v in t["points"]))
                      for n, t in d["tables"].items()}
            return cls(_integer(d["batches"]), tables)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not an embcore profile: {e!r}") from None

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def of(cls, value: LookupProfile | str | os.PathLike | None) -> LookupProfile | None:
        """``Embedding(profile=...)``: a profile, the path of a saved one, or None.

        Raises:
            TypeError: anything else. ValueError: a file that is not a profile.
        """
        if isinstance(value, (str, os.PathLike)):
            return cls.load(value)
        if value is not None and not isinstance(value, LookupProfile):
            raise TypeError(f"profile must be an ec.profile(...) result, its path or None, got "
                            f"{type(value).__name__}")
        return value

    def weigh(self, features: Features) -> tuple[dict[str, float], dict[str, Curve]]:
        """The planner's inputs for ``features``' tables: lookups per batch (measured where
        this profile has the table, else the number of features reading it) and the measured
        curves."""
        lookups: dict[str, float] = dict(features.lookups_per_table())
        lookups.update({n: v for n, v in self.lookups().items() if n in lookups})
        curves = {n: c for n, t, _ in features.table_specs()
                  if (c := self.curve(n, t.vocabulary_size)) is not None}
        return lookups, curves

    @classmethod
    def load(cls, path: str | os.PathLike) -> LookupProfile:
        """Raises ValueError naming ``path``: not JSON, or not a valid profile
        (``from_dict``)."""
        try:
            d = json.loads(Path(path).read_text())
        except (ValueError, RecursionError) as e:  # (JSONDecodeError, an integer's digits)
            raise ValueError(f"{path}: not an embcore profile (not JSON: {e})") from None
        try:
            return cls.from_dict(d) if isinstance(d, dict) else cls.from_dict({})
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _integer(x: Any) -> Any:
    """``x`` as an int when it is a whole number (JSON may write ``3.0``); else as it is, for
    ``LookupProfile``'s check to name (a float ``int()`` would turn NaN into an error of its
    own and truncate 2.5)."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _check_table(name: str, t: TableProfile) -> None:
    """``LookupProfile``'s check of one table's statistics (its docstring)."""
    if not isinstance(t, TableProfile):
        raise TypeError(f"profile: table {name!r} must be a TableProfile, got "
                        f"{type(t).__name__}")

    def bad(what: str, value: Any, want: str) -> ValueError:
        return ValueError(f"profile: table {name!r} has {what} {value!r}; it must be {want} "
                          f"(profile the batches again with ec.profile)")

    if not isinstance(t.lookups_per_batch, (int, float)) or isinstance(t.lookups_per_batch, bool) \
            or not math.isfinite(t.lookups_per_batch) or t.lookups_per_batch < 0:
        raise bad("lookups_per_batch", t.lookups_per_batch, "a finite number >= 0")
    if type(t.distinct) is not int or t.distinct < 0:
        raise bad("distinct", t.distinct, "an integer >= 0")
    last_k, last_share = 0, 0.0
    for k, share in t.points:
        if type(k) is not int or not last_k < k <= t.distinct:
            raise bad("the point k =", k, f"an integer above the previous point's ({last_k}) "
                                          f"and at most distinct ({t.distinct})")
        if not isinstance(share, (int, float)) or isinstance(share, bool) \
                or not last_share <= share <= 1:
            raise bad(f"the share at k = {k} of", share, f"a number from the previous point's "
                                                        f"({last_share}) to 1")
        last_k, last_share = k, float(share)


def plan_features(features: Features, world_size: int, sharding: Any, budget: int | None,
                  profile: LookupProfile | None) -> ShardingPlan:
    """The plan of an engine's tables (plan.py's ``make_plan``), its tables weighed by their
    lookups per batch and curves: measured where ``profile`` has them, else the number of
    features reading each table and the Zipf prior."""
    lookups, curves = (profile.weigh(features) if profile is not None
                       else (features.lookups_per_table(), {}))
    return make_plan(features.table_specs(), world_size, sharding, lookups, budget, curves)


def profile(batches: Iterable[Any], feature_config: Any,
            path: str | os.PathLike | None = None) -> LookupProfile:
    """Records per-table lookup statistics from sample ``batches``.

    Args:
        batches: an iterable of feature structures (as ``enqueue`` takes them), or of
            ``(features, weights)`` pairs.
        feature_config: the engine's feature_config.
        path: where to write the profile (JSON, a few KB), or None.

    Returns:
        The ``LookupProfile``; pass it (or its path) as ``Embedding(profile=...)``.

    Raises:
        ValueError / TypeError: batches that ``enqueue`` would refuse, naming the feature.
    """

    features = Features(feature_config, None)
    # per id seen (a static table's rows too: nothing per row of the table, whatever its size)
    counts: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}    # a table's ids seen, ascending
    ids_seen: dict[str, int] = {}
    n_batches = 0
    for batch in batches:
        feats, weights = batch if isinstance(batch, tuple) and len(batch) == 2 and not \
            isinstance(batch[0], torch.Tensor) else (batch, None)
        bags = features.bags(feats, weights, torch.device("cpu"), host(), Shapes.CHECK)
        n_batches += 1
        for table, b in zip(features.tables, bags):
            if b is None:
                continue
            ids = b.ids
            ids_seen[table] = ids_seen.get(table, 0) + ids.numel()
            if table in seen:  # merge with the ids seen so far
                ids = torch.cat([seen[table], ids])
            seen[table], inverse = torch.unique(ids, return_inverse=True)
            c = torch.zeros(seen[table].numel(), dtype=torch.int64)
            prev = counts.get(table)
            if prev is not None:  # the old ids came first, once each, with their counts
                c.index_add_(0, inverse[:prev.numel()], prev)
                inverse = inverse[prev.numel():]
            c.index_add_(0, inverse, torch.ones_like(inverse))
            counts[table] = c
    tables = {}
    for table, c in counts.items():
        freq = torch.sort(c[c > 0].double(), descending=True)[0]
        tables[table] = TableProfile(ids_seen[table] / max(n_batches, 1), int(freq.numel()),
                                     _points(freq))
    out = LookupProfile(n_batches, tables)
    if path is not None:
        out.save(path)
    return out


def _points(freq: torch.Tensor) -> tuple[tuple[int, float], ...]:
    """``(k, share of the k most frequent)`` at k = 1, 2, 4, ... and the number of ids seen."""
    if freq.numel() == 0:
        return ()
    share = freq.cumsum(0) / freq.sum()  # (n,)
    ks, k = [], 1
    while k < freq.numel():
        ks.append(k)
        k = max(k + 1, int(k * 1.5))
    ks.append(int(freq.numel()))
    return tuple((k, min(float(share[k - 1]), 1.0)) for k in ks)  # (cumsum / sum: 1 + 1e-16)
