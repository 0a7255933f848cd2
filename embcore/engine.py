"""The engine (``ec.Embedding``): a thin shell over the three verbs of a step.

``enqueue`` -> ``preprocess`` (preprocess.py), ``dequeue`` -> ``lookup`` (lookup.py),
``apply_gradients`` -> ``apply_gradients`` (gradients.py), over the rows of a ``RowStore``
(store.py). This file owns only the protocol (the queue, its order and its errors: a rejected call
changes nothing), pipelining and the public API (docs/architecture.md).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch

from .base.comm import Communicator, make_communicator
from .base.nest import flatten_like, unflatten_like
from .base.version import __version__
from .config.budget import parse_budget
from .config.optimizers import Optimizer
from .config.spec import EmbeddingSpec
from .config.tables import TableConfig
from .inputs.features import Features, is_feature
from .ops import native
from .planning.plan import ShardingPlan, make_plan
from .planning.profile import LookupProfile
from .state.store import RowStore
from .step.fast import DensePath
from .step.gradients import (
    apply_gradients,
    check_gradients,
    gradient_multipliers,
    learning_rates,
    nonfinite_gradients,
)
from .step.lookup import Received, lookup
from .step.preprocess import Prepared, preprocess
from .step.queue import StepQueue, TrainingStep

F = TypeVar("F", bound=Callable[..., Any])


def _serialized(method: F) -> F:
    """One call at a time per engine: a method holding the engine's lock runs alone, so threads
    sharing an engine see each call whole (the protocol's order is still theirs to keep; a call
    out of order raises as usual)."""
    @functools.wraps(method)
    def wrapper(self: Embedding, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return cast(F, wrapper)


class Embedding:
    """The embedding engine: tables, sparse optimizer, and the enqueue / dequeue / apply protocol.

    Args:
        feature_config: a FeatureConfig or a nested dict / list / tuple of them; every features,
            weights, activations and gradients structure mirrors it.
        optimizer: the embcore optimizer of tables that have none of their own (``None``: such
            tables can be looked up but not trained).
        pipeline_execution: False: every lookup happens at ``dequeue`` and sees every earlier
            update (exact). True: ``enqueue`` hands the batch's preprocessing (and with one
            process the lookup itself) to a background worker, so it overlaps your dense model;
            a batch enqueued before the previous batch's ``apply_gradients`` then sees the tables
            from before that update (one step stale, as TF's
            pipeline_execution_with_tensor_core). Either way each training dequeue must be
            followed by its ``apply_gradients`` before the next training dequeue.
        sharding: None, ``"auto"``, a strategy name or ``{table_name: strategy}``
            (docs/semantics.md section 5).
        process_group: the ``torch.distributed`` group to shard over (None: one process, or the
            default group when one is initialized). With more than one process, every method
            that touches tables (enqueue excepted) is a collective: all processes call it, in
            the same order.
        device: where tables, slots and the step's work live (default CPU).
        timeout: seconds (or a timedelta) any collective may wait before raising
            ``embcore.base.comm.CollectiveError`` (a process died or stalls); default 300.
        memory_budget: None, or the bytes (an int, or a string like ``"4GiB"``) this process's
            tables, slots and caches may take in fast memory. Tables beyond it go to a slow
            tier with their hot rows in a write-back cache; results are bit-identical
            (docs/semantics.md section 10; ``print(emb.plan)`` shows the tiers).
        offload_dir: where the slow tier's files go on the CPU (None: a temporary directory);
            they are scratch, removed with the engine (checkpoints are ``ec.save``'s).
        profile: lookup statistics from ``ec.profile`` (or the path of one it saved): the
            planner weighs tables by their measured lookups and sizes caches from their curves.

    Raises:
        ValueError / TypeError: invalid structures, duplicate names, bad optimizers.

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
                 profile: LookupProfile | str | os.PathLike | None = None) -> None:
        self._lock = threading.RLock()  # see _serialized
        budget = parse_budget(memory_budget)
        # what a spec of this engine holds (manifest): the arguments as given
        self._spec_args = (optimizer, sharding, memory_budget, bool(pipeline_execution))
        if offload_dir is not None and not isinstance(offload_dir, (str, os.PathLike)):
            raise TypeError(f"offload_dir must be a path or None, got "
                            f"{type(offload_dir).__name__}")
        if offload_dir is not None and os.path.exists(offload_dir) and not os.path.isdir(
                offload_dir):
            raise ValueError(f"offload_dir={str(offload_dir)!r} exists and is not a directory")
        self._offload_dir = offload_dir
        if isinstance(profile, (str, os.PathLike)):
            profile = LookupProfile.load(profile)
        elif profile is not None and not isinstance(profile, LookupProfile):
            raise TypeError(f"profile must be an ec.profile(...) result, its path or None, got "
                            f"{type(profile).__name__}")
        self._features = Features(feature_config, optimizer)
        self._comm = make_communicator(process_group, timeout)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pipeline_execution = bool(pipeline_execution)
        specs = self._features.table_specs()
        lookups: dict[str, float] = dict(self._features.lookups_per_table())
        curves = {}
        if profile is not None:
            lookups.update({n: v for n, v in profile.lookups().items() if n in lookups})
            curves = {n: c for n, t, _ in specs
                      if (c := profile.curve(n, t.vocabulary_size)) is not None}
        self._plan = make_plan(specs, self._comm.world_size, sharding, lookups, budget, curves)
        # One draw from torch's global RNG (rank 0's when sharded): torch.manual_seed before
        # construction fixes the tables, whatever the world size and plan.
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        self._seed = int(self._comm.all_gather(seed.to(self.device))[0].item())
        self._store: RowStore | None = None
        self._dense: DensePath | None = None  # built with the store (dense.py)
        self._queue = StepQueue(self.pipeline_execution)
        self._step = 0

    @property
    def plan(self) -> ShardingPlan:
        """The frozen placement of every table (``print(emb.plan)``)."""
        return self._plan

    @_serialized
    def cache_stats(self) -> dict[str, dict[str, float | int]]:
        """``{table: {"hits": int, "misses": int, "new": int, "hit_rate": float}}`` for the
        tables in the slow tier (``memory_budget``), on this process: distinct rows of each step
        found in the cache, read from the slow tier, or given to a new id of a dynamic table in
        that step (nothing read), since construction; ``hit_rate`` is hits over all three.
        Tables in fast memory have no entry."""
        return self._built().cache_stats()

    @property
    def step(self) -> int:
        """Number of ``apply_gradients`` calls applied so far."""
        return self._step

    @property
    def feature_config(self) -> Any:
        return self._features.template

    @property
    def comm(self) -> Communicator:
        """The communicator over this engine's processes (``rank``, ``world_size``, and
        collectives with this engine's timeout); ``ec.save`` / ``ec.load`` use it."""
        return self._comm

    def table_names(self) -> dict[TableConfig, str]:
        """Every table's resolved name."""
        return dict(self._features.table_names)

    @_serialized
    def build(self, per_replica_input_shapes: Any = None,
              per_replica_batch_size: int | None = None) -> None:
        """Creates the tables and, optionally, fixes the activations' shapes.

        Optional: ``enqueue``, ``lookup`` and ``state_dict`` build on first use.

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
        self._built()

    @_serialized
    def to(self, device: torch.device | str) -> Embedding:
        """Moves the tables, slots and the step's work to ``device`` (one process only: a
        sharded engine's device is chosen at construction, with its process group).

        Raises:
            ValueError: not a device, sharded, or a batch is enqueued or awaits its gradients.
        """
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"to({device!r}): not a device ({e})") from None
        if device == self.device:
            return self
        if self._comm.world_size > 1:
            raise ValueError(f"a sharded engine cannot move from {self.device} to {device}; "
                             f"pass device= when constructing it (each process its own device)")
        self._queue.check_idle()
        if self._store is not None:
            self._store.to(device)
            self._dense = DensePath.of(self._features, self._plan, self._store,
                                       self._comm.world_size)
        self.device = device
        return self

    def _built(self) -> RowStore:
        if self._store is None:
            configs = {n: t for t, n in self._features.table_names.items()}
            self._store = RowStore(self._plan, configs, self._seed, self._comm, self.device,
                                   self._offload_dir)
            self._dense = DensePath.of(self._features, self._plan, self._store,
                                       self._comm.world_size)
        return self._store

    def _prepare_dense(self, features: Any, weights: Any, training: bool,
                       shapes: str) -> Prepared | None:
        """The batch through the dense path (dense.py), or None when it does not take it."""
        if weights is not None:
            return None
        self._built()
        return self._dense.prepare(features, training, shapes) if self._dense else None

    def _lookup(self, prepared: Prepared) -> tuple[list[torch.Tensor | None], Received]:
        """``lookup`` (lookup.py), or the dense path's for a batch it prepared."""
        store = self._built()
        if prepared.dense and self._dense is not None:
            flat = self._dense.lookup(prepared)
            if flat is not None:
                return flat, (None,) * len(prepared.tables)  # (no exchange, no map)
        return lookup(prepared, store, self._comm)

    @_serialized
    def enqueue(self, features: Any, weights: Any = None, training: bool = True,
                name: str | None = None, device: Any = None) -> None:
        """Hands a batch of ids to the engine; ``dequeue`` returns its activations.

        Args:
            features: mirrors feature_config; each leaf a dense, jagged or sparse COO id tensor.
            weights: None, or mirrors feature_config with None or a weight tensor per leaf.
            training: True when ``apply_gradients`` will follow the ``dequeue``.
            name, device: accepted for TF's signature and ignored (there is no op name here,
                and inputs are moved to the engine's ``device``).

        Raises:
            ValueError / TypeError: bad structures, ids, weights or shapes (naming the feature);
                a training enqueue with a table that has no optimizer.
            RuntimeError: enqueue again before the previous batch was dequeued.
        """
        self._queue.check_room()
        untrained = self._features.untrained_tables() if training else []
        if untrained:
            raise ValueError(f"tables {untrained} have no optimizer, so they cannot be trained; "
                             f"pass optimizer= to Embedding (or to their TableConfig), or "
                             f"enqueue with training=False")
        training = bool(training)
        if not self.pipeline_execution:
            prepared = self._prepare_dense(features, weights, training, "learn")
            if prepared is None:
                bags = self._features.bags(features, weights, self.device)
                prepared = preprocess(bags, self._features.tables, self._plan, training)
            self._queue.put(training, prepared)
            return
        bags = self._features.bags(features, weights, self.device)
        tables = self._features.tables
        store = self._built()

        def stage() -> tuple[Prepared, list[Any] | None, Received]:
            # one thread for the fused kernels here: the caller's model has the cores
            with native.single_threaded():
                prepared = preprocess(bags, tables, self._plan, training)
                if self._comm.world_size > 1:  # collectives stay on the caller's thread
                    return prepared, None, ()
                with torch.no_grad():
                    return (prepared, *lookup(prepared, store, self._comm))

        self._queue.put(training, background=stage)

    @_serialized
    def dequeue(self, name: str | None = None) -> Any:
        """Activations of the oldest enqueued batch, mirroring feature_config (``name``: TF's,
        ignored).

        Each activation has shape ``leading + (D,)``. After a ``training=True`` enqueue they are
        leaf tensors with ``requires_grad=True``: compute the loss, ``backward()``, and pass their
        ``.grad`` to ``apply_gradients`` (or use ``torch.autograd.grad``).

        Raises:
            RuntimeError: nothing enqueued, or a training batch dequeued before the previous
                training batch's ``apply_gradients``.
        """
        item = self._queue.take()
        try:
            prepared = item.wait()
            if item.activations is None:  # (combine builds no graph: the store's need none)
                item.activations, item.received = self._lookup(prepared)
        except BaseException:
            self._queue.discard(item)  # the batch is consumed; the engine takes the next one
            raise
        # the activations are the caller's leaves (detached unless they are already: the
        # kernels' outputs are, and a detach costs a microsecond each)
        flat = [(a.detach() if a.requires_grad else a).requires_grad_(item.training)
                for a in item.activations]
        return self._features.unflatten(flat)

    @_serialized
    def apply_gradients(self, gradients: Any, name: str | None = None, *,
                        warn_on_none: bool = True) -> None:
        """Applies the optimizer to the rows of the last training batch.

        Args:
            gradients: mirrors feature_config; each leaf the gradient of that feature's
                activation (same shape), or None for a zero gradient.
            name: TF's, ignored.
            warn_on_none: warn when a None gradient still moves rows (the optimizer changes rows
                on a zero gradient: Adam, FTRL, momentum, decay); ``EmbeddingLayer`` turns it off.

        Raises:
            RuntimeError: no training batch awaits gradients (none dequeued, a training=False
                enqueue, or apply_gradients already called for it).
            ValueError / TypeError: structure, type or shape mismatch, naming the feature.
                Nothing is changed.
        """
        item = self._queue.awaiting()
        self._apply_held(item.wait(), item.received, gradients, warn_on_none)
        self._queue.applied()

    def _apply_held(self, prepared: Prepared, received: Received, gradients: Any,
                    warn_on_none: bool) -> None:
        """Checks everything, then applies a training batch's gradients (one step); the caller
        holds the engine's lock (``_apply`` takes it)."""
        names, plan = self._features.names, self._plan
        flat = self._features.flat_dict(gradients)
        if flat is None:
            flat = flatten_like(self._features.template, gradients, is_feature, "gradients")
        path = self._dense if prepared.dense else None
        dense = path.gradients(prepared, flat) if path is not None else None
        if dense is None:
            grads = check_gradients(prepared, flat, names, plan, warn_on_none)
        gmul = gradient_multipliers(prepared, plan, self._step)  # these may raise: before any
        lrs = learning_rates(prepared, plan)  # write (and lrs last: a callable may count calls)
        if path is not None and dense is not None:  # (one kernel call per table)
            self._queue.wait_all()  # background lookups read the tables: let them finish first
            path.update(prepared, dense, lrs, gmul)
            self._step += 1
            return
        nonfinite = nonfinite_gradients(prepared, grads, names, plan)
        self._queue.wait_all()
        apply_gradients(prepared, received, grads, self._built(), self._comm, self._step, lrs,
                        gmul, nonfinite)
        self._step += 1

    _apply = _serialized(_apply_held)  # a training step's apply (TrainingStep)

    @_serialized
    def training_step(self, features: Any, weights: Any = None) -> TrainingStep:
        """A training batch looked up now, outside the queue: the step of ``EmbeddingLayer``.

        ``step.activations`` mirrors feature_config; ``step.apply(gradients)`` applies its
        gradients once, whenever it comes (a step never applied changes nothing and blocks
        nothing). Shapes are checked against those fixed by ``output_shape`` or ``build`` but
        batches fix none, so the batch size may vary (a partial last batch).

        Raises:
            ValueError / TypeError: as ``enqueue`` (nothing changes).
        """
        untrained = self._features.untrained_tables()
        if untrained:
            raise ValueError(f"tables {untrained} have no optimizer, so they cannot be trained; "
                             f"pass optimizer= to Embedding (or to their TableConfig)")
        prepared = self._prepare_dense(features, weights, True, "check")
        if prepared is None:
            bags = self._features.bags(features, weights, self.device, learn=False)
            prepared = preprocess(bags, self._features.tables, self._plan, True)
        self._queue.wait_all()
        flat, received = self._lookup(prepared)
        return TrainingStep(functools.partial(self._apply, prepared, received),
                            self._features.unflatten(flat))

    @_serialized
    def lookup(self, features: Any, weights: Any = None, *, serving_config: Any = None) -> Any:
        """Activations without the queue or any update (evaluation, serving).

        Batches of any shape are accepted (only ``output_shape`` in a FeatureConfig applies).
        ``serving_config``: the features to look up (default all of this engine's): some of its
        FeatureConfigs, or others reading its tables (TF's serving_config); ``features`` and the
        result mirror it.
        """
        template = self.feature_config if serving_config is None else serving_config
        prepared = (self._prepare_dense(features, weights, False, "any")
                    if serving_config is None else None)
        if prepared is None:
            bags, tables = self._features.serving_bags(template, features, weights, self.device)
            prepared = preprocess(bags, tables, self._plan, False)
        with torch.no_grad():
            flat, _ = self._lookup(prepared)
        return unflatten_like(template, flat, is_feature)

    @_serialized
    def vocabulary(self, table: TableConfig | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The resident ids of a dynamic table and their rows (docs/semantics.md section 9).

        Args:
            table: the dynamic table's ``TableConfig`` or name.

        Returns:
            ``(ids (R,) int64 ascending, rows (R,) int64)``: with one process (or a replicated
            table) the rows of ``embedding_tables[table]`` holding them; when sharded, the ids
            this process owns and their rows in its shard.

        Raises:
            ValueError: an unknown table, or one that is not dynamic.
        """
        names = self._features.table_names
        name = names.get(table) if isinstance(table, TableConfig) else table
        if name not in names.values():
            raise ValueError(f"{table!r} is not a table of this engine; its tables are "
                             f"{sorted(names.values())}")
        store = self._built()
        dyn = store.dynamic.get(self._plan.table(name).physical)
        if dyn is None:
            raise ValueError(f"table {name!r} is not dynamic: its ids are its rows (give it "
                             f"TableConfig(dynamic=ec.DynamicVocabulary()) for raw ids)")
        return dyn.resident()

    @_serialized
    def whole_vocabulary(self, table: TableConfig | str) -> tuple[torch.Tensor, torch.Tensor]:
        """A dynamic table's resident ids over all processes and their rows of the whole
        ``embedding_tables[table]`` (a collective when sharded): what serving needs."""
        ids, rows = self.vocabulary(table)
        name = self._features.table_names[table] if isinstance(table, TableConfig) else table
        place = self._plan.table(name)
        if place.layout.held_everywhere:
            return ids, rows
        rows = place.layout.local_rows(self._comm.rank)[rows]  # rows of the logical table
        w = self._comm.world_size
        all_ids = torch.cat(self._comm.all_to_all([ids] * w))
        all_rows = torch.cat(self._comm.all_to_all([rows.to(ids.device)] * w))
        order = torch.argsort(all_ids)
        return all_ids[order], all_rows[order]

    @property
    @_serialized
    def embedding_tables(self) -> dict[TableConfig, torch.Tensor]:
        """Whole logical tables, ``{TableConfig: (N, D) tensor}``.

        With one process these are views of the engine's tables (writing to them changes the
        engine). When sharded they are gathered copies, and reading them is a collective: every
        process must read it.
        """
        store = self._built()
        return {t: store.whole(n) for t, n in self._features.table_names.items()}

    @_serialized
    def state_dict(self) -> dict[str, Any]:
        """``{"<table>/parameters": (N, D), "<table>/<slot>": (N, D) or (N, 1), "step": ()}``.

        Slot names are TF's. With one process the values are views of the engine's tensors
        (whole logical tables). When sharded this is a collective and each value is this
        process's share as ``torch.distributed.checkpoint`` understands it (a ``DTensor`` of
        row blocks of the logical ``(N, C)`` table, a copy; a plain tensor for a replicated
        table); ``dcp.save`` / ``dcp.load`` (what ``ec.save`` / ``ec.load`` use) then reshard
        to any other plan or world size.
        """
        out = self._built().state_dict()
        out["step"] = torch.tensor(self._step, dtype=torch.int64)
        return out

    @_serialized
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Copies tables, slots and the step in; with ``strict=False`` missing keys are kept.

        Values may be whole ``(N, C)`` tensors (each process takes its rows) or, when sharded,
        the values of a ``state_dict()`` of this engine filled by ``dcp.load``.

        Raises:
            KeyError: with ``strict``, missing keys; always, unknown keys.
            ValueError: a shape mismatch, naming the key. Nothing is changed on error.
        """
        self._built().load_state_dict(state_dict, strict)
        if "step" in state_dict:
            self._step = int(state_dict["step"])

    def manifest(self) -> dict[str, Any]:
        """JSON-able description of the configs, plan and step (for checkpoints), with the
        engine's ``EmbeddingSpec`` as data (``spec``; None, and ``spec_error`` saying why, when
        a callable in it is not data)."""
        optimizer, sharding, budget, pipelined = self._spec_args
        try:
            spec: dict[str, Any] | None = EmbeddingSpec(
                self._features.template, optimizer, sharding=sharding, memory_budget=budget,
                pipeline_execution=pipelined).to_dict()
            error = None
        except (ValueError, TypeError) as e:
            spec, error = None, str(e)
        return {"embcore_version": __version__, "step": self._step,
                **self._features.describe(self._plan), "plan": self._plan.describe(),
                "world_size": self._plan.world_size, "spec": spec,
                **({"spec_error": error} if error else {})}

    @classmethod
    def from_spec(cls, spec: EmbeddingSpec, **kwargs: Any) -> Embedding:
        """The engine ``spec`` describes; ``kwargs``: the arguments a spec does not hold
        (``process_group``, ``device``, ``timeout``, ``offload_dir``, ``profile``)."""
        if not isinstance(spec, EmbeddingSpec):
            raise TypeError(f"from_spec takes an ec.EmbeddingSpec, got {type(spec).__name__}")
        return cls(spec.feature_config, spec.optimizer, sharding=spec.sharding,
                   memory_budget=spec.memory_budget,
                   pipeline_execution=spec.pipeline_execution, **kwargs)

    def __repr__(self) -> str:
        return (f"Embedding({len(self._features)} features, {len(self._features.table_names)} "
                f"tables, step={self._step}, device={self.device})")

