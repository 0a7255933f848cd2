"""The engine (``ec.Embedding``): holds the physical tables and their optimizer slots, and composes
inputs -> preprocess -> lookup -> gradient -> optimizer update for every step.

It is the thin stateful shell over the functional core: every computation lives in inputs.py,
preprocess.py, ops/ and optimizers.py; this file owns the tensors and the protocol
(enqueue -> dequeue -> apply_gradients) and checks it, so that a rejected call changes nothing.
"""

from __future__ import annotations

import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from . import __version__
from .comm import make_communicator
from .config import FeatureConfig, TableConfig, initial_rows, resolve_table_names
from .exchange import fetch_rows, gradients_at_owner
from .inputs import canonicalize, output_shape_from_input_shape, resolve_shape
from .nest import flatten_like, leaves_with_paths, unflatten_like
from .ops.lookup import combine, combine_backward
from .ops.memory import empty_table
from .ops.update import (apply_in_place, fast_update_supported, native_rule, update_from_outputs,
                         update_rows)
from .ops.workspace import Workspace
from .optimizers import Optimizer
from .plan import ShardingPlan, make_plan
from .preprocess import Route, TableBatch, group_by_physical, route
from .shards import from_value, gather_whole, to_sharded


def is_feature(x: Any) -> bool:
    return isinstance(x, FeatureConfig)


@dataclass
class _Prepared:
    """An enqueued batch: ids grouped, deduplicated, routed, ready for the lookup."""

    training: bool
    tables: list[TableBatch] = field(default_factory=list)
    routes: list[Route | None] = field(default_factory=list)
    # Filled by the lookup of a sharded table: the shard rows each rank asked this rank for.
    received: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # Pipelined mode: the background work (grouping, and at W = 1 the lookup) and its result.
    pending: Future | None = None
    prefetched: list[Any] | None = None

    def wait(self) -> None:
        """Waits for the background work of this batch, if any."""
        if self.pending is not None:
            self.tables, self.routes, self.prefetched = self.pending.result()
            self.pending = None


class Embedding:
    """The embedding engine: tables, sparse optimizer, and the enqueue / dequeue / apply protocol.

    Args:
        feature_config: a FeatureConfig or a nested dict / list / tuple of them; every features,
            weights, activations and gradients structure mirrors it.
        optimizer: the embcore optimizer of tables that have none of their own (``None``: such
            tables can be looked up but not trained).
        pipeline_execution: False: every lookup happens at ``dequeue`` and sees every earlier
            update (exact). True: ``enqueue`` hands the batch's grouping, deduplication and
            routing (and with one process the lookup itself) to a background worker, so it
            overlaps your dense model; a batch enqueued before the previous batch's
            ``apply_gradients`` then sees the tables from before that update (one step stale,
            as TF's pipeline_execution_with_tensor_core). Either way each training dequeue
            must be followed by its ``apply_gradients`` before the next training dequeue.
        sharding: None, ``"auto"``, a strategy name or ``{table_name: strategy}`` (DESIGN 2.5).
        process_group: the ``torch.distributed`` group to shard over (None: one process, or the
            default group when one is initialized). With more than one process, every method
            that touches tables (enqueue excepted) is a collective: all processes call it, in
            the same order.
        device: where tables, slots and the step's work live (default CPU).
        timeout: seconds (or a timedelta) any collective may wait before raising
            ``embcore.comm.CollectiveError`` (a process died or stalls); default 300.

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
                 timeout: float | timedelta | None = None) -> None:
        self._template = feature_config
        flat = leaves_with_paths(feature_config, is_feature)
        if not flat:
            raise ValueError("feature_config holds no FeatureConfig")
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an embcore optimizer (ec.SGD, ec.Adagrad, ...) or "
                            f"None, got {type(optimizer).__name__}")
        self._features: list[FeatureConfig] = [f for _, f in flat]
        self._feature_names = [f.name or (p or "feature") for p, f in flat]
        dup = {n for n in self._feature_names if self._feature_names.count(n) > 1}
        if dup:
            raise ValueError(f"feature names {sorted(dup)} are used twice; give features unique "
                             f"names")
        if len({id(f) for f in self._features}) != len(self._features):
            raise ValueError("one FeatureConfig object appears twice in feature_config; create a "
                             "FeatureConfig per feature (they may share a TableConfig)")
        tables = list(dict.fromkeys(f.table for f in self._features))  # first-use order
        self._table_names = resolve_table_names(tables)
        self._optimizers = {t: t.optimizer if t.optimizer is not None else optimizer
                            for t in tables}
        self._feature_tables = [self._table_names[f.table] for f in self._features]
        self._comm = make_communicator(process_group, timeout)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pipeline_execution = bool(pipeline_execution)
        lookups = {self._table_names[t]: sum(f.table is t for f in self._features) for t in tables}
        self._plan = make_plan([(self._table_names[t], t, self._optimizers[t]) for t in tables],
                               self._comm.world_size, sharding, lookups)
        # One draw from torch's global RNG (rank 0's when sharded): torch.manual_seed before
        # construction fixes the tables, whatever the world size and plan.
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        self._seed = int(self._comm.all_gather(seed.to(self._comm_device()))[0].item())
        self._weights: list[torch.Tensor] = []
        self._slots: list[dict[str, torch.Tensor]] = []
        self._shapes: list[tuple[int, ...] | None] = [None] * len(self._features)
        self._queue: deque[_Prepared] = deque()
        self._awaiting: _Prepared | None = None
        self._last_dequeue_training: bool | None = None
        self._step = 0
        self._worker: ThreadPoolExecutor | None = None
        self._workspace = Workspace()  # the update's temporaries, kept across steps

    # ----------------------------------------------------------------------------- building
    @property
    def plan(self) -> ShardingPlan:
        """The frozen placement of every table (``print(emb.plan)``)."""
        return self._plan

    @property
    def step(self) -> int:
        """Number of ``apply_gradients`` calls applied so far."""
        return self._step

    @property
    def feature_config(self) -> Any:
        return self._template

    def build(self, per_replica_input_shapes: Any = None,
              per_replica_batch_size: int | None = None) -> None:
        """Creates the tables and, optionally, fixes the activations' shapes.

        Optional: ``enqueue``, ``lookup`` and ``state_dict`` build on first use.

        Args:
            per_replica_input_shapes: a structure mirroring feature_config of input shapes whose
                last dim counts ids per bag (``[B, 1]``, ``[B, L]``; ``[B, L, 1]`` for a dense
                ``[B, L]`` input looked up id by id); sets each feature's output shape.
            per_replica_batch_size: the simpler form: output ``[B]`` (``[B, L]`` for sequence
                features of length L).

        Raises:
            ValueError: a structure mismatch, or a shape conflicting with one already fixed.
        """
        shapes: list[tuple[int, ...] | None] = [None] * len(self._features)
        if per_replica_input_shapes is not None:
            flat = flatten_like(self._template, per_replica_input_shapes, is_feature,
                                "per_replica_input_shapes")
            shapes = [output_shape_from_input_shape(f, tuple(s), n)
                      for f, s, n in zip(self._features, flat, self._feature_names)]
        elif per_replica_batch_size is not None:
            b = int(per_replica_batch_size)
            shapes = [(b, f.max_sequence_length) if f.max_sequence_length else (b,)
                      for f in self._features]
        for i, s in enumerate(shapes):
            if s is not None and self._shapes[i] is not None and self._shapes[i] != s:
                raise ValueError(f"feature {self._feature_names[i]!r}: build() shape {list(s)} "
                                 f"conflicts with the shape {list(self._shapes[i] or ())} already "
                                 f"fixed")
        for i, s in enumerate(shapes):
            if s is not None:
                self._shapes[i] = s
        self._ensure_built()

    def _comm_device(self) -> torch.device:
        """Where collectives' tensors live: the engine's device (NCCL needs CUDA tensors)."""
        return self.device

    def _ensure_built(self) -> None:
        """Creates this rank's shard of every physical table and its slots."""
        if self._weights:
            return
        names_to_cfg = {n: t for t, n in self._table_names.items()}
        rank, world = self._comm.rank, self._comm.world_size
        for p in self._plan.physical:
            c0, c1 = p.columns[rank]
            n_local = p.local_rows[rank]
            w = empty_table((n_local, c1 - c0), p.dtype, self.device)  # (N_r, D_r)
            for name in p.tables:
                place = self._plan.table(name)
                rows = place.rank_rows(rank, world)
                start = place.local_offsets[rank]
                if c0 == 0 and c1 == p.dim:  # whole rows: initialised in place
                    initial_rows(names_to_cfg[name], name, self._seed, rows,
                                 out=w[start:start + len(rows)])
                else:
                    values = initial_rows(names_to_cfg[name], name, self._seed, rows)  # (n, D)
                    w[start:start + len(rows)] = values[:, c0:c1].to(self.device)
            slot_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            slots = {s.name: empty_table((n_local, 1 if s.rowwise else c1 - c0), slot_dtype,
                                         self.device).fill_(s.initial_value)
                     for s in (p.optimizer.slots if p.optimizer is not None else ())}
            self._weights.append(w)
            self._slots.append(slots)

    # ----------------------------------------------------------------------------- the protocol
    def enqueue(self, features: Any, weights: Any = None, training: bool = True) -> None:
        """Hands a batch of ids to the engine; ``dequeue`` returns its activations.

        Args:
            features: mirrors feature_config; each leaf a dense, jagged or sparse COO id tensor.
            weights: None, or mirrors feature_config with None or a weight tensor per leaf.
            training: True when ``apply_gradients`` will follow the ``dequeue``.

        Raises:
            ValueError / TypeError: bad structures, ids, weights or shapes (naming the feature);
                a training enqueue with a table that has no optimizer.
            RuntimeError: enqueue again before the previous batch was dequeued.
        """
        limit = 2 if self.pipeline_execution else 1
        if len(self._queue) >= limit:
            raise RuntimeError("enqueue() called again before dequeue() of the batch already "
                               "enqueued; call dequeue() after every enqueue()")
        if training:
            untrained = [self._table_names[t] for t, o in self._optimizers.items() if o is None]
            if untrained:
                raise ValueError(f"tables {untrained} have no optimizer, so they cannot be "
                                 f"trained; pass optimizer= to Embedding (or to their "
                                 f"TableConfig), or enqueue with training=False")
        canon, shapes = self._canonicalize(self._template, features, weights, fixed=True)
        for i, s in enumerate(shapes):  # only now, once the whole batch is accepted
            if s is not None and self._shapes[i] is None and self._features[i].output_shape is None:
                self._shapes[i] = s
        item = _Prepared(bool(training))
        if self.pipeline_execution:
            self._ensure_built()
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embcore")
            # Collectives stay on the caller's thread (every rank must issue them in one
            # order), so with several processes only the local preparation runs ahead.
            ahead = self._comm.world_size == 1
            item.pending = self._worker.submit(self._stage, canon, shapes, ahead)
        else:
            item.tables, item.routes = self._group(canon, shapes)
        self._queue.append(item)

    def _stage(self, canon: list[Any], shapes: list[tuple[int, ...] | None],
               lookup: bool) -> tuple[list[TableBatch], list[Route | None], list[Any] | None]:
        """Background part of a pipelined enqueue."""
        tables, routes = self._group(canon, shapes)
        if not lookup:
            return tables, routes, None
        with torch.no_grad():
            return tables, routes, self._activations(_Prepared(False, tables, routes))

    def dequeue(self) -> Any:
        """Activations of the oldest enqueued batch, mirroring feature_config.

        Each activation has shape ``leading + (D,)``. After a ``training=True`` enqueue they are
        leaf tensors with ``requires_grad=True``: compute the loss, ``backward()``, and pass their
        ``.grad`` to ``apply_gradients`` (or use ``torch.autograd.grad``).

        Raises:
            RuntimeError: nothing enqueued, or a training batch dequeued before the previous
                training batch's ``apply_gradients``.
        """
        flat = self._dequeue_flat()
        training = self._last_dequeue_training
        flat = [a.detach().requires_grad_(bool(training)) for a in flat]
        return unflatten_like(self._template, flat, is_feature)

    def _dequeue_flat(self) -> list[torch.Tensor]:
        if not self._queue:
            raise RuntimeError("dequeue() called with nothing enqueued; call enqueue(features) "
                               "first")
        batch = self._queue[0]
        if batch.training and self._awaiting is not None:
            raise RuntimeError("dequeue() of a training batch before apply_gradients() of the "
                               "previous training batch; call apply_gradients() once per training "
                               "dequeue()")
        self._queue.popleft()
        self._ensure_built()
        batch.wait()
        flat = batch.prefetched if batch.prefetched is not None else self._activations(batch)
        self._last_dequeue_training = batch.training
        if batch.training:
            self._awaiting = batch
        return flat

    def apply_gradients(self, gradients: Any) -> None:
        """Applies the optimizer to the rows of the last training batch.

        Args:
            gradients: mirrors feature_config; each leaf the gradient of that feature's
                activation (same shape), or None for a zero gradient (warned about when the
                optimizer moves rows on a zero gradient, e.g. Adam, FTRL, momentum, decay).

        Raises:
            RuntimeError: no training batch awaits gradients (none dequeued, a training=False
                enqueue, or apply_gradients already called for it).
            ValueError: structure or shape mismatch, naming the feature. Nothing is changed.
        """
        flat = flatten_like(self._template, gradients, is_feature, "gradients")
        self._apply_flat(flat, warn_none=True)

    def _apply_flat(self, flat: list[torch.Tensor | None], warn_none: bool) -> None:
        if self._awaiting is None:
            if self._last_dequeue_training is False:
                raise RuntimeError("apply_gradients() after a training=False enqueue: there are "
                                   "no training activations to apply gradients to; enqueue with "
                                   "training=True")
            if self._last_dequeue_training is True:
                raise RuntimeError("apply_gradients() called twice for one training batch; call "
                                   "it once per dequeue()")
            raise RuntimeError("apply_gradients() without a training batch; call "
                               "enqueue(..., training=True) and dequeue() first")
        batch = self._awaiting
        for queued in self._queue:  # background lookups read the tables: let them finish first
            queued.wait()
        grads: list[torch.Tensor | None] = [None] * len(self._features)
        for tb in batch.tables:
            dim = self._plan.physical[tb.physical].dim
            for s in tb.slices:
                g = flat[s.feature]
                if g is None:
                    continue
                if not isinstance(g, torch.Tensor):
                    raise TypeError(f"gradient of feature {self._feature_names[s.feature]!r} must "
                                    f"be a tensor or None, got {type(g).__name__}")
                if g.shape != s.shape + (dim,):
                    raise ValueError(f"gradient of feature {self._feature_names[s.feature]!r} has "
                                     f"shape {list(g.shape)}, expected {list(s.shape + (dim,))} "
                                     f"(the shape of its activation)")
                grads[s.feature] = g.detach() if g.requires_grad else g
        used = batch.tables
        if warn_none and any(g is None for g in grads):
            noisy = sorted({self._feature_names[s.feature] for tb in used for s in tb.slices
                            if flat[s.feature] is None and not self._physical_opt(tb)
                            .zero_gradient_is_noop})
            if noisy:
                warnings.warn(f"features {noisy} got a None gradient; their optimizer changes "
                              f"rows even on a zero gradient (momentum, Adam, FTRL, weight decay "
                              f"or clipping), so their looked-up rows still move", stacklevel=3)
        # Evaluate every learning rate before touching any table (a bad one rejects the call).
        lrs: dict[int, float] = {}
        for tb in used:
            opt = self._physical_opt(tb)
            if id(opt) not in lrs:
                lrs[id(opt)] = opt.current_learning_rate()
        for k, tb in enumerate(used):
            p = self._plan.physical[tb.physical]
            work = torch.float64 if p.dtype == torch.float64 else torch.float32
            parts = [grads[s.feature] for s in tb.slices]
            parts = [g.reshape(s.rows, p.dim).to(self.device, work) if g is not None else
                     torch.zeros(s.rows, p.dim, dtype=work, device=self.device)
                     for g, s in zip(parts, tb.slices)]
            opt = self._physical_opt(tb)
            rule = native_rule(opt, self._weights[tb.physical])
            if rule is not None and self._comm.world_size == 1:  # backward fused into the update
                update_from_outputs(rule, opt, self._weights[tb.physical], self._slots[tb.physical],
                                    tb, [g.contiguous() for g in parts], lrs[id(opt)], self._step)
                continue
            if len(parts) > 1:
                grad_out = self._workspace.get("out_grads", (tb.num_rows, p.dim), work,
                                               self.device)  # (R, D)
                torch.cat(parts, out=grad_out)
            else:
                grad_out = parts[0]  # (R, D)
            g_unique = combine_backward(grad_out, tb, self._workspace)  # (U, D)
            rows, g = gradients_at_owner(self._comm, self._plan.physical[tb.physical], tb,
                                         batch.routes[k], batch.received.get(k), g_unique)
            self._update(tb.physical, rows, g, opt, lrs[id(opt)])
        self._step += 1
        self._awaiting = None

    def _physical_opt(self, tb: TableBatch) -> Optimizer:
        opt = self._plan.physical[tb.physical].optimizer
        assert opt is not None, "training enqueue checked every table has an optimizer"
        return opt

    def _update(self, p: int, rows: torch.Tensor, grad: torch.Tensor, opt: Optimizer,
                lr: float) -> None:
        """Gathers the touched rows and slots, applies the rule, scatters them back."""
        w, slots = self._weights[p], self._slots[p]
        rule = native_rule(opt, w)
        if rule is not None:
            update_rows(rule, opt, w, slots, rows, grad, lr, self._step)
            return
        if fast_update_supported(opt, w):
            apply_in_place(opt, w, slots, rows, grad, lr, self._workspace)
            return
        if opt.dense_update:  # every row moves, untouched ones with g = 0
            full = torch.zeros(w.shape, dtype=grad.dtype, device=grad.device)  # (N_p, D)
            full[rows] = grad
            rows, grad = torch.arange(w.shape[0], device=w.device), full
        new_w, new_slots = opt.update(w[rows], grad, {k: v[rows] for k, v in slots.items()},
                                      lr=lr, step=self._step)
        w.index_copy_(0, rows, new_w)
        for k, v in new_slots.items():
            slots[k].index_copy_(0, rows, v)

    def lookup(self, features: Any, weights: Any = None) -> Any:
        """Activations without the queue or any update (evaluation, serving).

        Batches of any shape are accepted (only ``output_shape`` in a FeatureConfig applies).
        """
        return self._lookup(self._template, features, weights)

    def _lookup(self, template: Any, features: Any, weights: Any) -> Any:
        """Lookup of the features of ``template``, a sub-structure of this engine's features."""
        index = {id(f): i for i, f in enumerate(self._features)}
        flat_sub = [f for _, f in leaves_with_paths(template, is_feature)]
        missing = [repr(f) for f in flat_sub if id(f) not in index]
        if missing:
            raise ValueError(f"serving_config holds features this engine does not have: {missing}")
        self._ensure_built()
        canon, shapes = self._canonicalize(template, features, weights, fixed=False)
        batches, routes = self._group(canon, shapes)
        with torch.no_grad():
            flat = self._activations(_Prepared(False, batches, routes))
        return unflatten_like(template, [flat[index[id(f)]] for f in flat_sub], is_feature)

    def _canonicalize(self, template: Any, features: Any, weights: Any,
                      fixed: bool) -> tuple[list[Any], list[tuple[int, ...] | None]]:
        """Validates and canonicalizes a batch of ``template``'s features (no state changes)."""
        if template is self._template:
            sub = list(range(len(self._features)))
        else:
            index = {id(f): i for i, f in enumerate(self._features)}
            sub = [index[id(f)] for _, f in leaves_with_paths(template, is_feature)]
        flat_ids = flatten_like(template, features, is_feature, "features")
        flat_w = (flatten_like(template, weights, is_feature, "weights") if weights is not None
                  else [None] * len(sub))
        canon: list[Any] = [None] * len(self._features)
        shapes: list[tuple[int, ...] | None] = [None] * len(self._features)
        for i, ids, w in zip(sub, flat_ids, flat_w):
            f, name = self._features[i], self._feature_names[i]
            c = canonicalize(f, name, self._feature_tables[i], ids, w, self.device)
            shapes[i] = resolve_shape(f, name, c.shape, self._shapes[i] if fixed else None)
            canon[i] = c
        return canon, shapes

    def _group(self, canon: list[Any], shapes: list[tuple[int, ...] | None]
               ) -> tuple[list[TableBatch], list[Route | None]]:
        """Groups features per physical table, deduplicates and routes their ids (pure)."""
        full_shapes = [s if s is not None else () for s in shapes]
        tables = group_by_physical(self._plan, self._feature_tables, canon, full_shapes)
        return tables, [route(self._plan, tb.physical, tb.unique) for tb in tables]

    def _activations(self, batch: _Prepared) -> list[Any]:
        flat: list[Any] = [None] * len(self._features)
        for k, tb in enumerate(batch.tables):
            rt = batch.routes[k]
            if rt is None:  # rows held here: read them straight from the table
                out = combine(self._weights[tb.physical], tb.ids, tb)  # (R, D)
            else:
                rows, batch.received[k] = fetch_rows(self._comm, self._plan.physical[tb.physical],
                                                     self._weights[tb.physical], tb, rt)
                out = combine(rows, tb.inverse, tb)  # (R, D)
            for s in tb.slices:
                flat[s.feature] = out[s.start:s.start + s.rows].view(*s.shape, out.shape[1])
        return flat

    # ----------------------------------------------------------------------------- state
    @property
    def embedding_tables(self) -> dict[TableConfig, torch.Tensor]:
        """Whole logical tables, ``{TableConfig: (N, D) tensor}``.

        With one process these are views of the engine's tables (writing to them changes the
        engine). When sharded they are gathered copies, and reading them is a collective: every
        process must read it.
        """
        self._ensure_built()
        out = {}
        for t, name in self._table_names.items():
            place = self._plan.table(name)
            out[t] = gather_whole(place, self._plan.physical[place.physical],
                                  self._local(name, "parameters"), self._comm)
        return out

    def _local(self, name: str, key: str) -> torch.Tensor:
        """This rank's rows of a logical table's parameters or slot (a view)."""
        place = self._plan.table(name)
        full = (self._weights[place.physical] if key == "parameters"
                else self._slots[place.physical][key])
        start = place.local_offsets[self._comm.rank]
        return full[start:start + place.local_rows[self._comm.rank]]

    def _shapes_of_state(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for name in self._table_names.values():
            place = self._plan.table(name)
            opt = self._plan.physical[place.physical].optimizer
            out[f"{name}/parameters"] = (place.rows, place.dim)
            for spec in (opt.slots if opt is not None else ()):
                out[f"{name}/{spec.name}"] = (place.rows, 1 if spec.rowwise else place.dim)
        out["step"] = ()
        return out

    def table_names(self) -> dict[TableConfig, str]:
        """Every table's resolved name."""
        return dict(self._table_names)

    def state_dict(self) -> dict[str, Any]:
        """``{"<table>/parameters": (N, D), "<table>/<slot>": (N, D) or (N, 1), "step": ()}``.

        Slot names are TF's. With one process the values are views of the engine's tensors
        (whole logical tables). When sharded this is a collective and each value is this
        process's share as ``torch.distributed.checkpoint`` understands it: a ``DTensor``
        placed ``Shard(0)`` on the engine's process group, whose local tensor is this process's
        ``torch.chunk`` block of full rows of the logical ``(N, C)`` table (a copy), or a plain
        tensor for a replicated table; ``dcp.save`` / ``dcp.load`` (what ``ec.save`` /
        ``ec.load`` use) then reshard to any other plan or world size.
        """
        self._ensure_built()
        out: dict[str, Any] = {}
        for key, shape in self._shapes_of_state().items():
            if key == "step":
                continue
            name, slot = key.split("/", 1)
            local = self._local(name, slot)
            if self._comm.world_size == 1:
                out[key] = local
            else:
                place = self._plan.table(name)
                out[key] = to_sharded(place, self._plan.physical[place.physical], local,
                                      shape[1], self._comm)
        out["step"] = torch.tensor(self._step, dtype=torch.int64)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Copies tables, slots and the step in; with ``strict=False`` missing keys are kept.

        Values may be whole ``(N, C)`` tensors (each process takes its rows) or, when sharded,
        the values of a ``state_dict()`` of this engine filled by ``dcp.load``.

        Raises:
            KeyError: with ``strict``, missing keys; always, unknown keys.
            ValueError: a shape mismatch, naming the key. Nothing is changed on error.
        """
        self._ensure_built()
        shapes = self._shapes_of_state()
        unknown = sorted(set(state_dict) - set(shapes))
        if unknown:
            raise KeyError(f"unexpected keys {unknown}; this engine has {sorted(shapes)}")
        missing = sorted(set(shapes) - set(state_dict))
        if strict and missing:
            raise KeyError(f"missing keys {missing} (load with strict=False for a partial load)")
        for k, v in state_dict.items():
            got = tuple(v.size()) if k != "step" else tuple(torch.as_tensor(v).shape)
            if got != shapes[k]:
                raise ValueError(f"{k!r}: shape {list(got)} does not match the engine's "
                                 f"{list(shapes[k])}")
        new: dict[str, torch.Tensor] = {}
        for k, v in state_dict.items():  # all conversions (and collectives) before any write
            if k != "step":
                name, slot = k.split("/", 1)
                place = self._plan.table(name)
                new[k] = from_value(place, self._plan.physical[place.physical], v, self._comm)
        for k, v in new.items():
            name, slot = k.split("/", 1)
            self._local(name, slot).copy_(v)
        if "step" in state_dict:
            self._step = int(state_dict["step"])

    def manifest(self) -> dict[str, Any]:
        """JSON-able description of the configs, plan and step (for checkpoints)."""
        tables = {}
        for t, name in self._table_names.items():
            opt = self._optimizers[t]
            tables[name] = {"vocabulary_size": t.vocabulary_size, "dim": t.dim,
                            "combiner": t.combiner, "dtype": str(t.dtype).replace("torch.", ""),
                            "optimizer": repr(opt) if opt is not None else None,
                            "slots": list(self._plan.table(name).slot_names)}
        features = [{"name": n, "table": tn, "max_sequence_length": f.max_sequence_length}
                    for n, tn, f in zip(self._feature_names, self._feature_tables, self._features)]
        return {"embcore_version": __version__, "step": self._step, "tables": tables,
                "features": features, "plan": self._plan.describe(),
                "world_size": self._plan.world_size}

    def __repr__(self) -> str:
        return (f"Embedding({len(self._features)} features, {len(self._table_names)} tables, "
                f"step={self._step}, device={self.device})")
