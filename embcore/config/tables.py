"""Table and feature configs: what a user declares.

Both classes are frozen, keyword-only dataclasses validated on construction: a field of the wrong
type raises ``TypeError``, a field of the right type with a wrong value ``ValueError``, each naming
the field and the value. The library never mutates them; table names the user did not give are
resolved by ``resolve_table_names`` (called by the engine and by ``serving_embedding_lookup``) and
kept beside the configs, not written into them. Configs compare and hash by identity: two tables
with the same fields are still two tables. How features' inputs become activations:
docs/semantics.md sections 1-2.

Sizes are bounded where a bigger one cannot be real: counts that are int64 values in the engine
(``vocabulary_size``, ``dim``, ``admit_after``, ``ttl_steps``) at most ``2**63 - 1``; a table at
most ``MAX_TABLE_BYTES`` (``2**48`` bytes, 256 TiB: the whole 48-bit virtual address space of
common x86-64 and ARM64 machines, more than any of them can hold or map from disk);
``max_sequence_length`` at most ``MAX_SEQUENCE_LENGTH`` (``2**31 - 1``). Big tables within the
bound are fine (10**9 rows of 128 float32 is 512 GB, for a ``memory_budget`` to offload).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .dtypes import ROW_DTYPES

Combiner = Literal["sum", "mean", "sqrtn"]
COMBINERS = ("sum", "mean", "sqrtn")

# Rows are initialized in blocks of this many rows, each block from its own seeded generator, so a
# process holding any subset of a table's rows can create exactly those rows without creating the
# rest: the same seed gives the same table however it is sharded.
INIT_BLOCK_ROWS = 65536

Initializer = Callable[[torch.Tensor], Any] | torch.Tensor
EVICTIONS = ("lru", "lfu")

INT64_MAX = 2**63 - 1  # ids, rows, steps and counts are int64 in the engine
# Fast-memory bytes of a dynamic table's map per row of capacity, at most (state/vocab/): the
# torch-ops VocabMap of other devices holds 49 (33 of per-row state, 16 of sorted ids and rows);
# the CPU's NativeVocabMap 30 when full (20 of per-row state, 10 of int32 hash slots; 42 past
# 2**31 - 1 training steps, 40 in a shard of 2**31 rows or more, 52 with both), less until then
# (it holds the rows in use, and half more at most): what a ``memory_budget`` charges for it,
# and what a table's size counts.
MAP_BYTES_PER_ROW = 49
# Fast-memory bytes of an offloaded table's cache (state/tier/index.py) per cache row: its owner,
# stamp, dirty and fresh flags, free-stack entry and its row's version (4: the version its checksum
# is keyed to, held in ``where`` for the rows not cached); and per row of an offloaded shard: where
# it is cached; and per row of a slow tier written as a log (a static table's on the CPU,
# state/tier/log.py): its place (4) and the owners of its 1.5 places and a segment more (7). The
# planner charges them all (the log's on every device).
INDEX_BYTES_PER_ROW = 30
WHERE_BYTES_PER_ROW = 4
LOG_BYTES_PER_ROW = 11
# The most bytes a table may take: parameters (vocabulary_size * dim * the dtype's size) plus, for
# a dynamic table, its map (MAP_BYTES_PER_ROW, per row of capacity). 2**48 bytes
# (256 TiB) is the whole 48-bit virtual address space of common x86-64 and ARM64 machines: a
# table beyond it cannot be held or mapped from disk there, and is almost surely a typo (10**15
# rows) or a swapped argument, refused at construction instead of failing in an allocation later.
MAX_TABLE_BYTES = 2**48
MAX_SEQUENCE_LENGTH = 2**31 - 1  # a sequence feature's S: beyond it, [B, S, D] cannot be real
# The number arguments of the torch.nn.init functions a spec can write (spec.py, INITIALIZERS),
# checked when a table is built from functools.partial(torch.nn.init.<f>, **numbers).
INIT_NUMBER_ARGS = {"uniform_": ("a", "b"), "normal_": ("mean", "std"),
                    "trunc_normal_": ("mean", "std", "a", "b"), "constant_": ("val",),
                    "zeros_": (), "ones_": ()}


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
        admit_after: training steps an id must be seen in before it gets a row (1: at once;
            at most ``2**63 - 1``: counts are int64).
        ttl_steps: None, or evict ids unused for more than this many training steps (at the
            start of a step; at most ``2**63 - 1``: steps are int64).

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
        _check_int(self.admit_after, "admit_after", where, minimum=1, maximum=INT64_MAX)
        if self.ttl_steps is not None:
            _check_int(self.ttl_steps, "ttl_steps", where, minimum=1, maximum=INT64_MAX)

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
            b=.05)``, whose number arguments are checked here: finite, ``a <= b``, ``std >= 0``
            (``> 0`` for ``trunc_normal_``), names the function takes), which must treat
            entries independently (it is called on blocks of rows);
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
        dtype: the parameters' floating dtype. ``torch.float16`` and ``torch.bfloat16`` are compact
            rows (docs/semantics.md section 14): half the bytes of float32, activations still
            float32, each update computed in float32 from the widened row and rounded back.
            ``torch.float8_e4m3fn`` and ``torch.float8_e5m2`` are 8-bit rows, each with a
            float32 scale (its value ``code * scale``; the same section).
        stochastic_rounding: how a float16 / bfloat16 / 8-bit table's updates are rounded back
            into its rows: stochastically (True, the default: unbiased, with random bits that are a
            function of the table, the step, the row and the column only), or to nearest
            (False: an update below half a unit in the last place is then lost). Ignored for
            float32 and float64 tables.
        dynamic: None (ids are row numbers), or an ``ec.DynamicVocabulary``: ids are raw int64
            values that the engine maps to rows, admitting and evicting them (a tensor
            initializer does not apply then: rows have no fixed ids).

    Raises:
        TypeError: a field of the wrong type (a non-int size, a non-string combiner or name, a
            dtype that is not floating point, an initializer or optimizer of another kind, a
            ``torch.nn.init`` partial with an argument its function does not take).
        ValueError: a field of the right type with a wrong value (a size < 1 or > 2**63 - 1, a
            table of more than ``MAX_TABLE_BYTES`` = 2**48 bytes, naming the bytes it would
            take; an unknown combiner, an empty name or one holding '/', an initializer tensor
            of another shape, a ``torch.nn.init`` partial with a NaN / infinite argument,
            ``a > b`` or a negative ``std``).

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
    stochastic_rounding: bool = True

    def __post_init__(self) -> None:
        where = f"TableConfig(name={self.name!r})"
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(f"{where}: stochastic_rounding must be a bool, got "
                            f"{type(self.stochastic_rounding).__name__} "
                            f"{self.stochastic_rounding!r}")
        if self.dynamic is not None and not isinstance(self.dynamic, DynamicVocabulary):
            raise TypeError(f"{where}: dynamic must be None or an ec.DynamicVocabulary, got "
                            f"{type(self.dynamic).__name__}")
        if self.dynamic is not None and isinstance(self.initializer, torch.Tensor):
            raise ValueError(f"{where}: a dynamic table's rows have no fixed ids, so an "
                             f"initializer tensor cannot apply; use a callable initializer")
        _check_int(self.vocabulary_size, "vocabulary_size", where, minimum=1, maximum=INT64_MAX)
        _check_int(self.dim, "dim", where, minimum=1, maximum=INT64_MAX)
        if not isinstance(self.combiner, str):
            raise TypeError(f"{where}: combiner must be a string, one of {COMBINERS}, got "
                            f"{type(self.combiner).__name__} {self.combiner!r}")
        if self.combiner not in COMBINERS:
            raise ValueError(f"{where}: combiner must be one of {COMBINERS}, got {self.combiner!r}")
        if self.name is not None:
            _check_name(self.name, where, allow_slash=False)
        if self.dtype not in ROW_DTYPES:  # the element type: a non-float one is a TypeError
            raise TypeError(f"{where}: dtype must be one of {ROW_DTYPES}, got {self.dtype}")
        _check_bytes(self, where)
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
        elif init is not None:
            check_init_partial(init, where)
        if self.optimizer is not None:
            from .optimizers import Optimizer  # local: optimizers never import config
            if not isinstance(self.optimizer, Optimizer):
                raise TypeError(f"{where}: optimizer must be an embcore optimizer (ec.SGD, "
                                f"ec.Adagrad, ...), got {type(self.optimizer).__name__}")

    def __repr__(self) -> str:
        return (f"TableConfig(name={self.name!r}, vocabulary_size={self.vocabulary_size}, "
                f"dim={self.dim}, combiner={self.combiner!r}, dtype={self.dtype}"
                + (f", dynamic={self.dynamic}" if self.dynamic is not None else "")
                + (", stochastic_rounding=False" if not self.stochastic_rounding else "") + ")")


@dataclass(frozen=True, kw_only=True, eq=False)
class FeatureConfig:
    """One input feature, looked up in ``table``.

    Args:
        table: the ``TableConfig`` it reads; several features may share one table.
        max_sequence_length: 0 for a bag feature (ids of a row combined by the table's
            combiner); ``S > 0`` for a sequence feature: no combining, output ``[B, S, D]``,
            ids past ``S`` dropped, missing positions zero. At most ``2**31 - 1``.
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
            output_shape that is not a sequence of ints, a non-bool
            validate_weights_and_indices, a non-string name).
        ValueError: a max_sequence_length < 0 or > 2**31 - 1, an empty output_shape or one with
            an entry < 1 or more than 2**63 - 1 entries in all, an empty name.

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
        _check_int(self.max_sequence_length, "max_sequence_length", where, minimum=0,
                   maximum=MAX_SEQUENCE_LENGTH,
                   why="2**31 - 1: a sequence feature's activations are [batch, S, dim]")
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
            if math.prod(shape) > INT64_MAX:
                raise ValueError(f"{where}: output_shape {self.output_shape!r} has "
                                 f"{math.prod(shape)} entries, more than a tensor can index "
                                 f"(2**63 - 1)")
            object.__setattr__(self, "output_shape", shape)  # normalise once, at construction
        if not isinstance(self.validate_weights_and_indices, bool):
            raise TypeError(f"{where}: validate_weights_and_indices must be a bool, got "
                            f"{type(self.validate_weights_and_indices).__name__} "
                            f"{self.validate_weights_and_indices!r}")
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


def _check_int(value: Any, arg: str, where: str, minimum: int, maximum: int | None = None,
               why: str = "2**63 - 1: it is an int64 in the engine") -> None:
    """``TypeError`` unless ``value`` is an int (bool is not), ``ValueError`` if below minimum
    or above maximum (``why``: the maximum written as a power of 2 and where it comes from)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{where}: {arg} must be an int >= {minimum}, got "
                        f"{type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {arg} must be an int >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{where}: {arg} must be at most {maximum} ({why}), got {value!r}")


def table_bytes(table: TableConfig) -> int:
    """The bytes a table takes: its parameters (``vocabulary_size * dim`` of its dtype) and, for
    a dynamic table, its map (``MAP_BYTES_PER_ROW`` per row of capacity); optimizer slots
    not counted."""
    size = table.vocabulary_size * table.dim * table.dtype.itemsize
    if table.dynamic is not None:
        size += table.vocabulary_size * MAP_BYTES_PER_ROW
    return size


def _check_bytes(table: TableConfig, where: str) -> None:
    """``ValueError`` naming the bytes a table would take when they exceed MAX_TABLE_BYTES."""
    size = table_bytes(table)
    if size > MAX_TABLE_BYTES:
        dyn = (" plus its dynamic vocabulary's map" if table.dynamic is not None else "")
        raise ValueError(
            f"{where}: {table.vocabulary_size} rows x {table.dim} x {table.dtype.itemsize} bytes "
            f"({table.dtype}){dyn} would take {size} bytes ({_human(size)}), more than a "
            f"48-bit address space can map: a table takes at most 2**48 bytes (256 TiB); is "
            f"vocabulary_size or dim mistyped?")


def _human(size: int) -> str:
    """``size`` bytes in the largest binary unit that keeps a number >= 1 (e.g. '7.1 EiB')."""
    for unit, scale in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"


def check_init_partial(init: Any, where: str) -> None:
    """Checks ``functools.partial(torch.nn.init.<f>, **kwargs)`` (``f`` one of
    ``INIT_NUMBER_ARGS``'s, no positional arguments) before it runs: a keyword ``f`` does not
    take is a ``TypeError``; a number argument that is NaN or infinite, ``a > b``
    (``uniform_``, ``trunc_normal_``), a negative ``std`` (``normal_``) or one <= 0
    (``trunc_normal_``, which divides by it) a ``ValueError``, naming the function and the
    argument. Other callables, and arguments that are not numbers, are left to the call."""
    if (not isinstance(init, functools.partial) or init.args
            or getattr(init.func, "__module__", "") != "torch.nn.init"
            or getattr(init.func, "__name__", "") not in INIT_NUMBER_ARGS):
        return
    name = init.func.__name__
    what = f"{where}: initializer torch.nn.init.{name}"
    params = dict(list(inspect.signature(init.func).parameters.items())[1:])  # after the tensor
    unknown = [k for k in init.keywords if k not in params]
    missing = [k for k, p in params.items()
               if p.default is inspect.Parameter.empty and k not in init.keywords]
    if unknown or missing:
        raise TypeError(f"{what} " + (f"takes no argument {unknown[0]!r}" if unknown else
                                      f"needs the argument {missing[0]!r}")
                        + f"; its number arguments are {list(INIT_NUMBER_ARGS[name]) or 'none'}")
    args = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    args.update(init.keywords)
    given = {k: v for k, v in args.items() if k in INIT_NUMBER_ARGS[name]
             and isinstance(v, numbers.Real) and not isinstance(v, bool)}
    for k, v in given.items():
        if not math.isfinite(v):
            raise ValueError(f"{what}: {k} must be finite, got {v!r}")
    lo, hi = given.get("a"), given.get("b")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"{what}: a={lo!r} is greater than b={hi!r}; the values are drawn "
                         f"from [a, b]")
    std = given.get("std")
    if std is not None and (std < 0 or (name == "trunc_normal_" and std == 0)):
        bound = "> 0" if name == "trunc_normal_" else ">= 0"
        raise ValueError(f"{what}: std must be {bound}, got {std!r}")


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


def _fill(init: Callable[..., Any], block: torch.Tensor, table: str,
          in_place: bool | None = None, check: bool = True) -> bool:
    """Runs an initializer on one block of rows: ``init(block)`` filling it in place (torch's
    ``nn.init`` convention) or, when it takes ``(shape, dtype)``, TF's convention of returning the
    values. A block left with NaN or infinite values (an initializer that does not fill its
    argument) is a ValueError naming the table.

    Returns whether ``init`` filled in place; a caller running it on many blocks passes that
    back as ``in_place`` (no second try), with ``check=False`` when it fills ``block`` with NaN
    and checks the values itself."""
    if check:
        block.fill_(float("nan"))
    torch_style: TypeError | None = None
    if in_place is not False:
        try:
            init(block)
            in_place = True
        except TypeError as e:
            if in_place:  # (known to fill in place: its own error)
                raise
            torch_style, in_place = e, False
    if not in_place:
        try:
            values = init(tuple(block.shape), block.dtype)
        except TypeError:
            if torch_style is None:
                raise
            raise torch_style from None
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != tuple(block.shape):
            raise TypeError(f"table {table!r}: initializer({tuple(block.shape)}, {block.dtype}) "
                            f"returned {type(values).__name__} "
                            f"{tuple(getattr(values, 'shape', ()))}, not a tensor of that "
                            f"shape") from None
        block.copy_(values)
    if check:
        _check_filled(block, table)
    return in_place


def _check_filled(block: torch.Tensor, table: str) -> None:
    """ValueError naming the table when ``block`` holds NaN or infinite values."""
    if not bool(torch.isfinite(block).all()):
        raise ValueError(f"table {table!r}: its initializer left NaN or infinite values; it must "
                         f"fill the tensor it is given in place (like torch.nn.init.uniform_) or "
                         f"take (shape, dtype) and return the values")
