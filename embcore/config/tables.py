"""Table and feature configs: what a user declares.

Both classes are frozen, keyword-only dataclasses validated on construction: a field of the wrong
type raises ``TypeError``, a field of the right type with a wrong value ``ValueError``, each naming
the field and the value. The library never mutates them; table names the user did not give are
resolved by ``resolve_table_names`` (called by the engine and by ``serving_embedding_lookup``) and
kept beside the configs, not written into them. Configs compare and hash by identity: two tables
with the same fields are still two tables. How features' inputs become activations:
docs/semantics.md sections 1-2.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

Combiner = Literal["sum", "mean", "sqrtn"]
COMBINERS = ("sum", "mean", "sqrtn")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# Rows are initialized in blocks of this many rows, each block from its own seeded generator, so a
# process holding any subset of a table's rows can create exactly those rows without creating the
# rest: the same seed gives the same table however it is sharded.
INIT_BLOCK_ROWS = 65536

Initializer = Callable[[torch.Tensor], Any] | torch.Tensor
EVICTIONS = ("lru", "lfu")


@dataclass(frozen=True, kw_only=True)
class DynamicVocabulary:
    """Makes a table's ids raw: any int64 value, mapped to rows inside the engine (a dynamic
    vocabulary; docs/semantics.md section 9).

    The table's ``vocabulary_size`` becomes its capacity: how many ids can be resident at once.
    A training step makes an id resident once it has been seen in ``admit_after`` training steps;
    a new id takes the lowest free row, else the resident id with the lowest score is evicted
    (``"lru"``: the last training step that used it; ``"lfu"``: how many training steps used it;
    ties: the smaller id), never one used by the step itself. Ids not resident look up zeros.

    Args:
        eviction: ``"lru"`` or ``"lfu"``.
        admit_after: training steps an id must be seen in before it gets a row (1: at once).
        ttl_steps: None, or evict ids unused for more than this many training steps (at the
            start of a step).

    Raises:
        TypeError / ValueError: a field of the wrong type or value, naming it.

    Example:
        >>> import embcore as ec
        >>> users = ec.TableConfig(vocabulary_size=100_000, dim=32, name="users",
        ...                        dynamic=ec.DynamicVocabulary(eviction="lfu", admit_after=2))
    """

    eviction: Literal["lru", "lfu"] = "lru"
    admit_after: int = 1
    ttl_steps: int | None = None

    def __post_init__(self) -> None:
        where = "DynamicVocabulary"
        if not isinstance(self.eviction, str):
            raise TypeError(f"{where}: eviction must be one of {EVICTIONS}, got "
                            f"{type(self.eviction).__name__} {self.eviction!r}")
        if self.eviction not in EVICTIONS:
            raise ValueError(f"{where}: eviction must be one of {EVICTIONS}, got "
                             f"{self.eviction!r}")
        _check_int(self.admit_after, "admit_after", where, minimum=1)
        if self.ttl_steps is not None:
            _check_int(self.ttl_steps, "ttl_steps", where, minimum=1)

    def describe(self) -> dict[str, Any]:
        """JSON-able fields (checkpoint manifests)."""
        return {"eviction": self.eviction, "admit_after": self.admit_after,
                "ttl_steps": self.ttl_steps}


@dataclass(frozen=True, kw_only=True, eq=False)
class TableConfig:
    """One embedding table.

    Args:
        vocabulary_size: number of rows ``N`` (ids are in ``[0, N)``; with ``dynamic``, any
            int64 value, and ``N`` is the capacity).
        dim: embedding width ``D``.
        initializer: ``None`` for TF's default, a truncated normal with mean 0 and stddev
            ``1/sqrt(dim)`` cut at two stddevs; or a callable that fills a tensor in place, in the
            style of ``torch.nn.init`` (e.g. ``functools.partial(torch.nn.init.uniform_, a=-.05,
            b=.05)``), which must treat entries independently (it is called on blocks of rows);
            or, TF's convention, a callable ``(shape, dtype) -> tensor`` of that shape; or a
            finite floating ``(vocabulary_size, dim)`` tensor of initial values (pretrained
            embeddings). An initializer that leaves values unset is an error at build.
            Random initializers draw from a generator seeded from ``torch``'s global RNG when the
            engine is constructed (rank 0's draw, when sharded): call ``torch.manual_seed(seed)``
            first for reproducible tables; the values do not depend on how the table is sharded.
        optimizer: an embcore optimizer for this table; overrides the engine's optimizer.
        combiner: how ids of one bag are combined: ``"sum"``, ``"mean"`` or ``"sqrtn"``.
        name: the table's name (checkpoint keys ``<name>/parameters``); ``None`` gives
            ``table_<i>`` in order of first use by the features.
        dtype: the parameters' floating dtype.
        dynamic: None (ids are row numbers), or an ``ec.DynamicVocabulary``: ids are raw int64
            values that the engine maps to rows, admitting and evicting them (a tensor
            initializer does not apply then: rows have no fixed ids).

    Raises:
        TypeError: a field of the wrong type (a non-int size, a non-string combiner or name, a
            dtype that is not floating point, an initializer or optimizer of another kind).
        ValueError: a field of the right type with a wrong value (a size < 1, an unknown
            combiner, an empty name or one holding '/', an initializer tensor of another shape).

    Example:
        >>> import embcore as ec
        >>> movies = ec.TableConfig(vocabulary_size=2048, dim=64, name="movies")
    """

    vocabulary_size: int
    dim: int
    initializer: Initializer | None = None
    optimizer: Any = None
    combiner: Combiner = "mean"
    name: str | None = None
    dtype: torch.dtype = torch.float32
    dynamic: DynamicVocabulary | None = None

    def __post_init__(self) -> None:
        where = f"TableConfig(name={self.name!r})"
        if self.dynamic is not None and not isinstance(self.dynamic, DynamicVocabulary):
            raise TypeError(f"{where}: dynamic must be None or an ec.DynamicVocabulary, got "
                            f"{type(self.dynamic).__name__}")
        if self.dynamic is not None and isinstance(self.initializer, torch.Tensor):
            raise ValueError(f"{where}: a dynamic table's rows have no fixed ids, so an "
                             f"initializer tensor cannot apply; use a callable initializer")
        _check_int(self.vocabulary_size, "vocabulary_size", where, minimum=1)
        _check_int(self.dim, "dim", where, minimum=1)
        if not isinstance(self.combiner, str):
            raise TypeError(f"{where}: combiner must be a string, one of {COMBINERS}, got "
                            f"{type(self.combiner).__name__} {self.combiner!r}")
        if self.combiner not in COMBINERS:
            raise ValueError(f"{where}: combiner must be one of {COMBINERS}, got {self.combiner!r}")
        if self.name is not None:
            _check_name(self.name, where, allow_slash=False)
        if self.dtype not in FLOAT_DTYPES:  # the element type: a non-float one is a TypeError
            raise TypeError(f"{where}: dtype must be one of {FLOAT_DTYPES}, got {self.dtype}")
        init = self.initializer
        if isinstance(init, torch.Tensor):
            if tuple(init.shape) != (self.vocabulary_size, self.dim):
                raise ValueError(f"{where}: an initializer tensor must have shape "
                                 f"({self.vocabulary_size}, {self.dim}), got {tuple(init.shape)}")
            if not init.is_floating_point():
                raise TypeError(f"{where}: an initializer tensor must be floating point, got "
                                f"{init.dtype}")
            if not bool(torch.isfinite(init).all()):
                raise ValueError(f"{where}: the initializer tensor holds NaN or infinite values")
        elif init is not None and not callable(init):
            raise TypeError(f"{where}: initializer must be None, a callable that fills a tensor "
                            f"in place, or a tensor; got {type(init).__name__}")
        if self.optimizer is not None:
            from .optimizers import Optimizer  # local: optimizers never import config
            if not isinstance(self.optimizer, Optimizer):
                raise TypeError(f"{where}: optimizer must be an embcore optimizer (ec.SGD, "
                                f"ec.Adagrad, ...), got {type(self.optimizer).__name__}")

    def __repr__(self) -> str:
        return (f"TableConfig(name={self.name!r}, vocabulary_size={self.vocabulary_size}, "
                f"dim={self.dim}, combiner={self.combiner!r}, dtype={self.dtype}"
                + (f", dynamic={self.dynamic}" if self.dynamic is not None else "") + ")")


@dataclass(frozen=True, kw_only=True, eq=False)
class FeatureConfig:
    """One input feature, looked up in ``table``.

    Args:
        table: the ``TableConfig`` it reads; several features may share one table.
        max_sequence_length: 0 for a bag feature (ids of a row combined by the table's
            combiner); ``S > 0`` for a sequence feature: no combining, output ``[B, S, D]``,
            ids past ``S`` dropped, missing positions zero.
        output_shape: the leading shape of this feature's activations (without ``D``); overrides
            the shape given to ``build`` and the one seen at the first enqueue. When set,
            ``max_sequence_length`` is ignored (as in TF): the feature's bags are combined.
        validate_weights_and_indices: also check that weights are finite (a pass over the
            weights; turn off once inputs are trusted). The checks that keep every read and
            write inside the table run whatever this says: ids in ``[0, vocabulary_size)``
            (one min / max pass), jagged offsets and sparse indices consistent with their
            values and shape, weights matching their ids.
        name: the feature's name in error messages; ``None`` uses its path in the structure.

    Raises:
        TypeError: a field of the wrong type (table, a non-int max_sequence_length, an
            output_shape that is not a sequence of ints, a non-string name).
        ValueError: a negative max_sequence_length, an empty output_shape or one with an entry
            < 1, an empty name.

    Example:
        >>> import embcore as ec
        >>> t = ec.TableConfig(vocabulary_size=100, dim=8)
        >>> history = ec.FeatureConfig(table=t, max_sequence_length=20, name="history")
    """

    table: TableConfig
    max_sequence_length: int = 0
    output_shape: Sequence[int] | None = None
    validate_weights_and_indices: bool = True
    name: str | None = None

    def __post_init__(self) -> None:
        where = f"FeatureConfig(name={self.name!r})"
        if not isinstance(self.table, TableConfig):
            raise TypeError(f"{where}: table must be a TableConfig, got "
                            f"{type(self.table).__name__}")
        _check_int(self.max_sequence_length, "max_sequence_length", where, minimum=0)
        if self.output_shape is not None:
            what = "output_shape must be a non-empty sequence of positive ints"
            if not isinstance(self.output_shape, Sequence) or isinstance(self.output_shape, str):
                raise TypeError(f"{where}: {what}, got {type(self.output_shape).__name__} "
                                f"{self.output_shape!r}")
            shape = tuple(self.output_shape)
            if any(not isinstance(s, int) or isinstance(s, bool) for s in shape):
                raise TypeError(f"{where}: {what}, got {self.output_shape!r}")
            if not shape or any(s < 1 for s in shape):
                raise ValueError(f"{where}: {what}, got {self.output_shape!r}")
            object.__setattr__(self, "output_shape", shape)  # normalise once, at construction
        if self.name is not None:
            _check_name(self.name, where, allow_slash=True)

    @property
    def sequence_length(self) -> int:
        """The sequence length in effect: ``max_sequence_length``, or 0 (a bag feature) when
        ``output_shape`` is set, which then decides the shape alone (as TF ignores
        max_sequence_length when output_shape is given)."""
        return 0 if self.output_shape is not None else self.max_sequence_length

    def __repr__(self) -> str:
        return (f"FeatureConfig(name={self.name!r}, table={self.table.name!r}, "
                f"max_sequence_length={self.max_sequence_length}, "
                f"output_shape={self.output_shape})")


def _check_int(value: Any, arg: str, where: str, minimum: int) -> None:
    """``TypeError`` unless ``value`` is an int (bool is not), ``ValueError`` if below minimum."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{where}: {arg} must be an int >= {minimum}, got "
                        f"{type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {arg} must be an int >= {minimum}, got {value!r}")


def _check_name(name: Any, where: str, allow_slash: bool) -> None:
    """``TypeError`` unless ``name`` is a string, ``ValueError`` if empty (or holding '/')."""
    what = "name must be a non-empty string" + ("" if allow_slash else " without '/'")
    if not isinstance(name, str):
        raise TypeError(f"{where}: {what}, got {type(name).__name__} {name!r}")
    if not name or (not allow_slash and "/" in name):
        raise ValueError(f"{where}: {what}, got {name!r}")


def resolve_table_names(tables_in_use_order: Sequence[TableConfig]) -> dict[TableConfig, str]:
    """Names every table: its own name, else ``table_<i>`` with ``i`` its first-use index.

    Raises:
        ValueError: when two tables end up with the same name.
    """
    names: dict[TableConfig, str] = {}
    owner: dict[str, TableConfig] = {}
    for i, table in enumerate(tables_in_use_order):
        name = table.name if table.name is not None else f"table_{i}"
        if name in owner:
            raise ValueError(f"two tables are named {name!r}; table names must be unique "
                             f"(give each TableConfig its own name=)")
        owner[name] = table
        names[table] = name
    return names


def init_seed(base_seed: int, table_name: str, block: int) -> int:
    """The seed of one block of a table's rows: a stable hash of (engine seed, table, block)."""
    digest = hashlib.blake2b(f"{base_seed}:{table_name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def default_initializer(dim: int) -> Callable[[torch.Tensor], Any]:
    """TF's default: truncated normal, mean 0, stddev ``1/sqrt(dim)``, cut at 2 stddevs."""
    std = 1.0 / math.sqrt(dim)

    def init(t: torch.Tensor) -> None:
        torch.nn.init.trunc_normal_(t, mean=0.0, std=std, a=-2 * std, b=2 * std)

    return init


def initial_rows(table: TableConfig, name: str, base_seed: int, rows: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Initial values of the given rows of a table, identical whatever subset is asked for.

    Args:
        table: the table's config.
        name: its resolved name (part of the seed).
        base_seed: the engine's seed.
        rows: (R,) int64 row ids, ascending.
        out: where to write them ((R, D), any device and dtype); None allocates on the CPU.
            Writing straight into the table saves a temporary as large as the table.

    Returns:
        (R, D) tensor: ``out``, or a new one of ``table.dtype`` on the CPU.
    """
    if out is None:
        out = torch.empty(len(rows), table.dim, dtype=table.dtype)  # (R, D)
    if isinstance(table.initializer, torch.Tensor):
        out.copy_(table.initializer.detach()[rows.to(table.initializer.device)])
        return out
    init = table.initializer if table.initializer is not None else default_initializer(table.dim)
    if len(rows) == 0:
        return out
    first, last = int(rows[0]), int(rows[-1])
    contiguous = last - first + 1 == len(rows)  # rows first..last: write block slices directly
    blocks = torch.div(rows, INIT_BLOCK_ROWS, rounding_mode="floor")
    for b in torch.unique(blocks).tolist():
        start = b * INIT_BLOCK_ROWS
        n = min(INIT_BLOCK_ROWS, table.vocabulary_size - start)
        block = torch.empty(n, table.dim, dtype=torch.float32)  # (n, D)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed(base_seed, name, b))
            _fill(init, block, name)
        if contiguous:
            lo, hi = max(start, first), min(start + n, last + 1)
            out[lo - first:hi - first] = block[lo - start:hi - start]
        else:
            sel = blocks == b
            out[sel.to(out.device)] = block[rows[sel] - start].to(out.device, out.dtype)
    return out


def _fill(init: Callable[..., Any], block: torch.Tensor, table: str) -> None:
    """Runs an initializer on one block of rows: ``init(block)`` filling it in place (torch's
    ``nn.init`` convention) or, when it takes ``(shape, dtype)``, TF's convention of returning the
    values. A block left with NaN or infinite values (an initializer that does not fill its
    argument) is a ValueError naming the table."""
    block.fill_(float("nan"))
    try:
        init(block)
    except TypeError as torch_style:
        try:
            values = init(tuple(block.shape), block.dtype)
        except TypeError:
            raise torch_style from None
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != tuple(block.shape):
            raise TypeError(f"table {table!r}: initializer({tuple(block.shape)}, {block.dtype}) "
                            f"returned {type(values).__name__} "
                            f"{tuple(getattr(values, 'shape', ()))}, not a tensor of that "
                            f"shape") from None
        block.copy_(values)
    if not bool(torch.isfinite(block).all()):
        raise ValueError(f"table {table!r}: its initializer left NaN or infinite values; it must "
                         f"fill the tensor it is given in place (like torch.nn.init.uniform_) or "
                         f"take (shape, dtype) and return the values")
