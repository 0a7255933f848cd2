"""The engine (``ec.Embedding``): a thin shell over the three verbs of a step.

Every public method reads: check, queue, one call of the engine's path (step/path.py), which
prepares a batch (``preprocess``, or for dense one-id batches the native preprocess:
step/native_prepare.py), looks it up (``lookup``) and applies its gradients (``apply_step``) over
the rows objects of a ``RowStore`` (state/store.py). This file owns only the queue's
order and its errors (a rejected call changes nothing), pipelining and the public API
(docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch

from .base.comm import Communicator, make_communicator, shared_seed
from .base.nest import unflatten_like
from .base.version import __version__
from .config.budget import parse_budget
from .config.exchange import ExchangeCompression
from .config.optimizers import Optimizer
from .config.spec import EmbeddingSpec, from_spec
from .config.tables import TableConfig
from .inputs.canonical import Verdicts
from .inputs.features import Features, Shapes, is_feature
from .ops.backend import choose
from .planning.plan import ShardingPlan
from .planning.profile import LookupProfile, plan_features
from .state.store import RowStore
from .state.tier.files import OffloadDir
from .step.codec import ExchangeCodec
from .step.exchange import Answers
from .step.gradients import reject_gradients
from .step.path import Batch, StepPath
from .step.queue import StepQueue, TrainingStep

F = TypeVar("F", bound=Callable[..., Any])


def _serialized(method: F) -> F:
    """One call at a time per engine: a method holding the engine's lock runs alone, so threads
    sharing an engine see each call whole (the protocol's order is still theirs to keep; a call
    out of order raises as usual)."""
    @functools.wraps(method)
    def wrapper(self: Embedding, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # (a traced step: one thread's, see docs/semantics.md)
            return method(self, *args, **kwargs)
        with self._lock:
            return method(self, *args, **kwargs)
    return cast(F, wrapper)


class EmbeddingTables(dict[Any, Any]):
    """``{TableConfig: (N, D) tensor}`` (``embedding_tables``) whose reads also take a table's
    resolved name: ``tables["users"]``, ``tables.get("users")``, ``"users" in tables``.

    A real dict keyed by the TableConfigs: iterating, ``keys()``, ``items()``, ``len()`` and
    equality are a plain dict's; a ``str`` never equals a ``TableConfig``, so a name and a
    config never stand for two tables.
    """

    def __init__(self, tables: Mapping[TableConfig, Any],
                 names: Mapping[TableConfig, str]) -> None:
        super().__init__(tables)
        self._configs = {n: t for t, n in names.items() if t in self}  # name -> config

    def _config(self, key: Any) -> Any:
        return self.__dict__.get("_configs", {}).get(key, key) if isinstance(key, str) else key

    def __getitem__(self, key: Any) -> Any:
        try:
            return super().__getitem__(self._config(key))
        except KeyError:
            if isinstance(key, str):
                raise KeyError(f"{key!r} is not a table here; its tables are "
                               f"{sorted(self.__dict__.get('_configs', {}))}") from None
            raise

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(self._config(key), default)

    def __contains__(self, key: Any) -> bool:
        return super().__contains__(self._config(key))


def _move_to(value: Any, here: torch.device, world_size: int) -> torch.device:
    """``to()``'s argument as a device; ValueError when it is none, or when a sharded engine
    would move (its processes chose their devices with their process group)."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"to({value!r}): not a device ({e})") from None
    if device != here and world_size > 1:
        raise ValueError(f"a sharded engine cannot move from {here} to {device}; pass device= "
                         f"when constructing it (each process its own device)")
    return device


class Embedding:
    """The embedding engine: tables, sparse optimizer, and the enqueue / dequeue / apply protocol.

    Args:
        feature_config: a FeatureConfig or a nested dict / list / tuple of them; every features,
            weights, activations and gradients structure mirrors it.
        optimizer: the embcore optimizer of tables that have none of their own (``None``: such
            tables can be looked up but not trained).
        pipeline_execution: False: lookups happen at ``dequeue`` and see every earlier update.
            True: ``enqueue`` hands the batch's preprocessing (with one process, its lookup too)
            to a background worker, overlapping your dense model; a batch enqueued before the
            previous ``apply_gradients`` sees the tables from before it (one step stale, as TF's
            pipeline_execution_with_tensor_core). Each training dequeue still needs its
            ``apply_gradients`` before the next training dequeue.
        sharding: None, ``"auto"``, a strategy name or ``{table_name: strategy}``
            (docs/semantics.md section 5).
        process_group: the ``torch.distributed`` group to shard over (None: the default group
            when one is initialized, else one process). With several processes every method
            that touches tables (enqueue excepted) is a collective, called by all in one order.
        device: where tables, slots and the step's work live (default CPU).
        timeout: seconds (or a timedelta) any collective may wait before raising
            ``embcore.base.comm.CollectiveError`` (a process died or stalls); default 300.
        memory_budget: None, or the bytes (an int, or a string like ``"4GiB"``) this process's
            tables, slots and caches may take in fast memory; the tables beyond it go to a slow
            tier, hot rows in a write-back cache, bit-identically (docs/semantics.md section 10).
        offload_dir: where the slow tier's files go on the CPU (None: a temporary directory);
            they are scratch, removed with the engine (checkpoints are ``ec.save``'s).
        profile: lookup statistics from ``ec.profile`` (or the path of one it saved): the
            planner weighs tables by their measured lookups and sizes caches from their curves.
        exchange_compression: what a sharded table's rows (forward) and row gradients
            (backward) travel as between processes: None or ``"fp32"`` (exact, the default),
            ``"bf16"``, ``"fp16"`` or ``"fp8"`` both ways, or an ``ec.ExchangeCompression``
            per direction (docs/semantics.md section 5). Ids travel exact; one process
            exchanges nothing.
        host_checks: check every batch's ids, jagged offsets and weights on the host, each
            error raised at once (debugging). False (the default): where the step runs on
            the Triton backend (a GPU), a training batch is checked on the device without
            waiting, a bad one changes nothing, and ``check()`` raises its error
            (docs/semantics.md section 2); every other backend checks on the host anyway.

    Raises:
        ValueError / TypeError: invalid structures, names, optimizers or arguments.

    Example:
        >>> import torch, embcore as ec
        >>> _ = torch.manual_seed(0)  # tables are drawn from torch's global RNG at construction
        >>> t = ec.TableConfig(vocabulary_size=10, dim=4, combiner="sum", name="t")
        >>> emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
        >>> emb.enqueue({"f": torch.tensor([1, 2, 2])})
        >>> act = emb.dequeue()["f"]          # (3, 4), requires_grad for your loss
        >>> act.sum().backward()
        >>> emb.apply_gradients({"f": act.grad})  # row 2 moves by 2 * 0.1, row 1 by 0.1
    """

    def __init__(self, feature_config: Any, optimizer: Optimizer | None = None, *,
                 pipeline_execution: bool = False,
                 sharding: str | Mapping[str, str] | None = None,
                 process_group: Any = None, device: torch.device | str | None = None,
                 timeout: float | timedelta | None = None,
                 memory_budget: int | str | None = None,
                 offload_dir: str | os.PathLike | None = None,
                 profile: LookupProfile | str | os.PathLike | None = None,
                 exchange_compression: ExchangeCompression | str | None = None,
                 host_checks: bool = False) -> None:
        if not isinstance(host_checks, bool):  # (a truthy string would silently switch modes)
            raise TypeError(f"Embedding: host_checks must be True or False, got "
                            f"{host_checks!r}")
        self._lock = threading.RLock()  # see _serialized
        budget, profile = parse_budget(memory_budget), LookupProfile.of(profile)
        compression = ExchangeCompression.of(exchange_compression)
        OffloadDir.check(offload_dir)
        self._offload_dir = offload_dir
        # what a spec of this engine holds (manifest): the arguments as given
        self._spec_args = (optimizer, sharding, memory_budget, bool(pipeline_execution),
                           compression)
        self._features = Features(feature_config, optimizer)
        self._comm = make_communicator(process_group, timeout)
        if self._comm.world_size > 1:
            self._comm.codec = ExchangeCodec.of(compression)
        self.exchange_compression = compression
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pipeline_execution = bool(pipeline_execution)
        self._plan = dataclasses.replace(  # the device's kernels, chosen once (printed)
            plan_features(self._features, self._comm.world_size, sharding, budget, profile),
            backend=choose(self.device).name)
        self._seed = shared_seed(self._comm, self.device)
        self._store: RowStore | None = None  # the rows, and the path over them (_ready)
        self._path: StepPath | None = None
        self._queue = StepQueue(self.pipeline_execution)
        self._step = 0
        # the verdicts of training batches checked on the device, read by ``check``
        self._verdicts = None if host_checks else Verdicts()

    @property
    def plan(self) -> ShardingPlan:
        """The frozen placement of every table (``print(emb.plan)``)."""
        return self._plan

    @_serialized
    def cache_stats(self) -> dict[str, dict[str, float | int]]:
        """``{table: {"hits", "misses", "new", "hit_rate"}}`` of the slow tier's tables on this
        process since construction: each step's distinct rows found in the cache, read from the
        slow tier, or given to a new id of a dynamic table (nothing read); ``hit_rate`` is hits
        over all three. Tables in fast memory have no entry."""
        return self._ready().store.cache_stats()

    @_serialized
    def exchange_stats(self, reset: bool = False) -> dict[str, dict[str, float | int]]:
        """What this process's collectives carried and took since construction (or the last
        ``reset``): ``{physical table: {"ids_sent", "ids_received", "rows_sent",
        "rows_received", "gradients_sent", "gradients_received", "collectives", "seconds"}}``.

        A physical table is named by its member tables joined by ``+`` (``print(emb.plan)``
        shows the stacking). Bytes are those sent to and received from the other processes (a
        process's chunk for itself stays in memory), as they travel: ids and their counts
        exact, rows forward and gradients backward in the compression's wire format; a
        replicated table's gradient ``all_reduce`` counts its tensors' bytes once each way.
        ``seconds`` is the host's wall time inside the collectives (waiting for the other
        processes included); a step's compute is the rest of its time. ``"other"`` holds the
        collectives of no table's exchange (a step's agreements, a replicated raw-id table's
        ids, checkpoints' gathers): their count and seconds. One process exchanges nothing:
        ``{}``. Divide by ``emb.step`` for a step's share; counting adds no synchronization.

        Args:
            reset: start counting again after this call.

        Example:
            >>> import embcore as ec
            >>> t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
            >>> ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(0.1)).exchange_stats()
            {}
        """
        out: dict[str, dict[str, float | int]] = {}
        for count, (sent, received, seconds, calls) in self._comm.counters.items():
            name, kind = ("+".join(count[0]), count[1]) if count is not None else ("other", "")
            entry = out.setdefault(name, {"ids_sent": 0, "ids_received": 0, "rows_sent": 0,
                                          "rows_received": 0, "gradients_sent": 0,
                                          "gradients_received": 0, "collectives": 0,
                                          "seconds": 0.0})
            if kind:
                entry[f"{kind}_sent"] += int(sent)
                entry[f"{kind}_received"] += int(received)
            entry["collectives"] += int(calls)
            entry["seconds"] += seconds
        if reset:
            self._comm.counters.clear()
        return out

    @property
    def step(self) -> int:
        """Number of ``apply_gradients`` calls applied so far."""
        return self._step

    @property
    def feature_config(self) -> Any:
        return self._features.template  # (as given)

    @property
    def comm(self) -> Communicator:
        """This engine's processes: ``rank``, ``world_size``, collectives with its timeout."""
        return self._comm

    def table_names(self) -> dict[TableConfig, str]:
        """Every table's resolved name."""
        return dict(self._features.table_names)

    @_serialized
    def build(self, per_replica_input_shapes: Any = None,
              per_replica_batch_size: int | None = None) -> None:
        """Creates the tables (else the first use does) and, optionally, fixes the activations'
        shapes.

        Args:
            per_replica_input_shapes: a structure mirroring feature_config of the inputs' own
                shapes; each sets its feature's output shape as the batch's kind reads it (a
                dense ``[B, L]``: ``[B, L]``; a jagged or sparse ``[B, L]``: ``[B]``).
            per_replica_batch_size: the simpler form: output ``[B]`` (``[B, L]`` for sequence
                features of length L).

        Raises:
            ValueError: a structure mismatch, or a shape conflicting with one already fixed.
        """
        self._features.fix_shapes(per_replica_input_shapes, per_replica_batch_size)
        self._ready()

    @_serialized
    def to(self, device: torch.device | str) -> Embedding:
        """Moves the tables, slots and the step's work to ``device`` (one process only: a
        sharded engine's device is chosen at construction). Raises ValueError: not a device,
        sharded, or a batch is enqueued or awaits its gradients."""
        device = _move_to(device, self.device, self._comm.world_size)
        if device == self.device:
            return self
        self._queue.check_idle()
        backend = choose(device)  # (the kernels chosen again, for the new device)
        if self._store is not None:
            self._store.to(device, backend)
        self._plan = dataclasses.replace(self._plan, backend=backend.name)
        self._path, self.device = None, device  # (the path is chosen again for the device)
        return self

    def _ready(self) -> StepPath:
        """The engine's path (``.store``: its rows), built on first use and again after ``to``."""
        if self._store is None:
            configs = {n: t for t, n in self._features.table_names.items()}
            self._store = RowStore(self._plan, configs, self._seed, self._comm, self.device,
                                   self._offload_dir)
        if self._path is None:
            self._path = StepPath(self._features, self._plan, self._store, self._comm,
                                  self._verdicts)
        return self._path

    @contextlib.contextmanager
    def quiescent(self) -> Iterator[RowStore]:
        """The engine's rows (its ``RowStore``, built if it was not), with the engine's lock
        held and its background work done: the rows as the last applied step left them, for
        code that reads them between steps (``ec.publish``). Not for a model's code: every
        other use of the rows goes through the engine's verbs."""
        with self._lock:
            self._queue.wait_all()
            yield self._ready().store

    @_serialized
    def enqueue(self, features: Any, weights: Any = None, training: bool = True,
                name: str | None = None, device: Any = None) -> None:
        """Hands a batch of ids to the engine; ``dequeue`` returns its activations.

        Args:
            features: mirrors feature_config; each leaf a dense, jagged or sparse COO id tensor.
            weights: None, or mirrors feature_config with None or a weight tensor per leaf.
            training: True when ``apply_gradients`` will follow the ``dequeue``.
            name: TF's, ignored.
            device: TF's, ignored (inputs move to the engine's ``device``).

        Raises:
            ValueError / TypeError: bad structures, ids, weights or shapes (naming the feature);
                a training enqueue with a table that has no optimizer.
            RuntimeError: enqueue again before the previous batch was dequeued.
        """
        self._queue.check_room()
        if training := bool(training):
            self._features.check_trainable(", or enqueue with training=False")
        path = self._ready()
        if self.pipeline_execution:
            self._queue.put(training, background=path.staged(features, weights, training))
        else:
            self._queue.put(training, path.prepare(features, weights, training, Shapes.FIX))

    @_serialized
    def check(self) -> None:
        """Raises the error of the first training batch since the last ``check`` that failed
        its input checks on the device (an id out of range, malformed jagged offsets, a
        non-finite weight), naming the feature and the value, with how many batches failed.
        Such a batch changed nothing: its activations were zeros, its ``apply_gradients``
        left every row and slot as they were (the step still counted). Only the Triton
        backend defers these checks (``host_checks=False``); elsewhere a bad batch raises at
        its ``enqueue`` and this returns at once. One read from the device, where some
        batches were checked there; call it where the step may wait (every few hundred
        steps, before a checkpoint, at the end of an epoch).

        Raises:
            ValueError: a batch failed its checks (forgotten once raised).

        Example:
            >>> import torch, embcore as ec
            >>> t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
            >>> emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
            >>> emb.check()  # (on the CPU a bad batch raises at its enqueue: nothing pending)
        """
        if self._verdicts is not None:
            self._verdicts.check()

    @_serialized
    def dequeue(self, name: str | None = None) -> Any:
        """Activations of the oldest enqueued batch, mirroring feature_config, each of shape
        ``leading + (D,)`` (``name``: TF's, ignored). After a ``training=True`` enqueue they are
        leaves with ``requires_grad=True``: compute the loss, ``backward()``, and pass their
        ``.grad`` to ``apply_gradients`` (or use ``torch.autograd.grad``). RuntimeError: nothing
        enqueued, or a training batch before the previous training batch's ``apply_gradients``.
        """
        return self._features.unflatten(self._queue.dequeue())

    @_serialized
    def apply_gradients(self, gradients: Any, name: str | None = None, *,
                        warn_on_none: bool = True) -> None:
        """Applies the optimizer to the rows of the last training batch (``name``: TF's, ignored).

        Args:
            gradients: mirrors feature_config; each leaf the gradient of that feature's
                activation (same shape), or None for a zero gradient.
            warn_on_none: warn when a None gradient still moves rows (the optimizer changes rows
                on a zero gradient: Adam, FTRL, momentum, decay); ``EmbeddingLayer`` turns it off.

        Raises:
            RuntimeError: no training batch awaits gradients (none dequeued, a training=False
                enqueue, or apply_gradients already called for it).
            ValueError / TypeError: structure, type or shape mismatch, naming the feature;
                nothing is changed.
            OverflowError: the update of a float16 / bfloat16 table overflows its dtype in
                some rows (their optimizer without ``skip_nonfinite_gradients``), naming the
                tables and rows: those rows are left as they were, the step is otherwise
                applied and counted (docs/semantics.md section 14).
        """
        item = self._queue.awaiting()
        overflow = self._apply(item.wait(), item.answers, gradients, warn_on_none)
        self._queue.applied()
        if overflow is not None:
            raise OverflowError(overflow)

    def _apply(self, batch: Batch, answers: Answers, gradients: Any,
               warn_on_none: bool) -> str | None:
        """Applies the batch's gradients and counts the step; returns the text of an overflow
        error to raise once the caller has recorded the batch applied, or None."""
        try:
            flat = self._features.flatten(gradients, "gradients")
        except (ValueError, TypeError) as e:  # (the other processes learn of it at once)
            reject_gradients(batch.prepared, self._plan, self._comm, self.device, e)
        overflow = batch.apply(answers, flat, self._step, warn_on_none,
                               before_write=self._queue.wait_all)
        self._step += 1
        return overflow

    _locked_apply = _serialized(_apply)  # a TrainingStep's (from autograd's backward)

    @_serialized
    def training_step(self, features: Any, weights: Any = None) -> TrainingStep:
        """A training batch looked up now, outside the queue: the step of ``EmbeddingLayer``.
        ``step.activations`` mirrors feature_config; ``step.apply(gradients)`` applies its
        gradients once, whenever it comes (a step never applied changes nothing, blocks
        nothing). Shapes are checked against those fixed by ``output_shape`` or ``build``;
        batches fix none, so the batch size may vary. Raises as ``enqueue``."""
        self._features.check_trainable()
        batch = self._ready().prepare(features, weights, True, Shapes.CHECK)
        self._queue.wait_all()
        activations, answers = batch.lookup()
        return TrainingStep(functools.partial(self._locked_apply, batch, answers),
                            self._features.unflatten(activations))

    @_serialized
    def lookup(self, features: Any, weights: Any = None, *, serving_config: Any = None) -> Any:
        """Activations without the queue or any update (evaluation, serving), for batches of
        any shape (only a FeatureConfig's ``output_shape`` applies). ``serving_config``: the
        features to look up (default all of this engine's): some of its FeatureConfigs, or
        others reading its tables (TF's serving_config); ``features`` and the result mirror it.
        """
        batch = self._ready().prepare(features, weights, False, Shapes.ANY, serving_config)
        with torch.no_grad():
            activations, _ = batch.lookup()
        template = self.feature_config if serving_config is None else serving_config
        return unflatten_like(template, activations, is_feature)

    @_serialized
    def vocabulary(self, table: TableConfig | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids (R,) int64 ascending, rows (R,) int64)``: a dynamic table's (its
        ``TableConfig`` or name) resident ids and their rows (docs/semantics.md section 9): with
        one process (or a replicated table) rows of ``embedding_tables[table]``; when sharded,
        the ids this process owns and their rows in its shard. ValueError: an unknown table,
        or one that is not dynamic."""
        return self._ready().store.vocabulary(self._features.table_name(table))

    @_serialized
    def whole_vocabulary(self, table: TableConfig | str) -> tuple[torch.Tensor, torch.Tensor]:
        """A dynamic table's resident ids over all processes and their rows of the whole
        ``embedding_tables[table]`` (a collective when sharded): what serving needs."""
        return self._ready().store.whole_vocabulary(self._features.table_name(table))

    @property
    @_serialized
    def embedding_tables(self) -> EmbeddingTables:
        """Whole logical tables, ``{TableConfig: (N, D) tensor}``, which also take a table's
        name (``emb.embedding_tables["users"]``, as ``vocabulary`` does): with one process views
        of the engine's tables (writing to them changes the engine); when sharded gathered
        copies, and reading them is a collective (every process must read it)."""
        store = self._ready().store
        names = self._features.table_names
        return EmbeddingTables({t: store.whole(n) for t, n in names.items()}, names)

    @_serialized
    def state_dict(self) -> dict[str, Any]:
        """``{"<table>/parameters": (N, D), "<table>/<slot>": (N, D) or (N, 1), "step": ()}``,
        slot names TF's. With one process: views of the engine's tensors (whole logical tables).
        When sharded, a collective: this process's share as ``torch.distributed.checkpoint``
        reads it (a ``DTensor`` of row blocks of the logical ``(N, C)`` table, a copy; a plain
        tensor for a replicated table), which ``dcp.save`` / ``dcp.load`` (``ec.save`` /
        ``ec.load``) reshard to any other plan or world size."""
        out = self._ready().store.state_dict()
        out["step"] = torch.tensor(self._step, dtype=torch.int64)
        return out

    @_serialized
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        saturate: bool = False) -> None:
        """Copies tables, slots and the step in (``strict=False``: missing keys are kept); values
        are whole ``(N, C)`` tensors (each process takes its rows) or, when sharded, those of a
        ``state_dict()`` of this engine filled by ``dcp.load``. A float16 / bfloat16 table's
        parameters given wider are narrowed as ``ec.load`` narrows them (docs/semantics.md
        section 14): to nearest, and a finite value that would become infinite is refused, or
        with ``saturate=True`` stored as the dtype's largest finite value of its sign.

        Raises:
            KeyError: with ``strict``, missing keys; always, unknown keys.
            ValueError: a shape mismatch, naming the key; without ``saturate``, values beyond a
                16-bit table's range, naming the table, its rows and the largest value.
                Nothing is changed on error.
        """
        self._ready().store.load_state_dict(state_dict, strict, saturate)
        if "step" in state_dict:
            self._step = int(state_dict["step"])

    def manifest(self) -> dict[str, Any]:
        """JSON-able description of the configs, plan and step (for checkpoints), with the
        engine's ``EmbeddingSpec`` as data (``spec``; None, and ``spec_error`` saying why, when
        a callable in it is not data)."""
        return {"embcore_version": __version__, "step": self._step,
                **self._features.describe(self._plan), "plan": self._plan.describe(),
                "world_size": self._plan.world_size,
                **EmbeddingSpec.manifest_entry(self._features.template, *self._spec_args)}

    @classmethod
    def from_spec(cls, spec: EmbeddingSpec, **kwargs: Any) -> Embedding:
        """The engine that ``spec`` describes (config/spec.py's ``from_spec``); ``kwargs``: the
        arguments a spec does not hold (``process_group``, ``device``, ``timeout``, ...)."""
        return from_spec(cls, spec, **kwargs)

    def __repr__(self) -> str:
        return (f"Embedding({len(self._features)} features, {len(self._features.table_names)} "
                f"tables, step={self._step}, device={self.device})")
