"""A step's path: the three verbs (prepare, lookup, apply) over one engine's features and rows.

There is one path. ``StepPath.prepare`` chooses how a batch is preprocessed, once per batch:
dense one-id batches of an engine that allows it take the native preprocess (native_prepare.py:
one fused kernel call per physical table), every other batch ``preprocess`` (preprocess.py);
both give the same ``Prepared``. From there every batch takes the same verbs (``Batch.lookup``
and ``Batch.apply``): ``lookup`` (lookup.py) and ``apply_step`` (gradients.py), whose rows
objects (state/rows.py) choose the kernels, once per table (``ops/combine.TableCombine``,
``ops/update.TableUpdate``). Nothing falls back in the middle of a batch.
Pipelined batches (``staged``) take the same route: the preprocess chosen now, on the caller's
thread, and the lookup on the pipeline's worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..base.comm import Communicator
from ..inputs.canonical import Verdicts
from ..inputs.features import Features, Shapes
from ..kernels import cpu
from ..planning.plan import ShardingPlan
from ..state.store import RowStore
from .exchange import Answers
from .gradients import apply_step
from .lookup import lookup
from .native_prepare import NativePrepare
from .preprocess import Prepared, preprocess

Activations = list[torch.Tensor | None]  # per feature (flat order): its activation, or None


@dataclass  # (not frozen: made every step, as preprocess.py's records)
class Batch:
    """A prepared batch and the path that prepared it (the one that looks it up and applies
    its gradients)."""

    path: StepPath
    prepared: Prepared

    def lookup(self) -> tuple[Activations, Answers]:
        """Per feature its ``shape + (D,)`` activation, and what the apply needs of the
        exchange (a collective when a table is sharded)."""
        path = self.path
        return lookup(self.prepared, path.store, path.comm)

    def apply(self, answers: Answers, grads: Sequence[object], step: int, warn_on_none: bool,
              before_write: Callable[[], None]) -> str | None:
        """Checks the flat gradients and evaluates multipliers and learning rates (raising
        before any write), calls ``before_write()``, then updates the batch's rows; returns the
        text of an overflow error to raise once the step is counted (``apply_step``), or None."""
        path = self.path
        return apply_step(self.prepared, answers, grads, path.features.names, path.store, path.comm,
                   step, warn_on_none, before_write)


class StepPath:
    """The verbs of a step over one engine's features, plan and rows (see the module's
    docstring).

    Args:
        features: the engine's features (their shapes are read and fixed as ``Shapes`` says).
        plan, store, comm: the engine's plan, rows and communicator.
        verdicts: where training batches are judged on the device (inputs/canonical.py
            ``Verdicts``) when every table's kernels read a verdict (the Triton kernels of
            static tables held here, one process); None: on the host, as every other path.
    """

    def __init__(self, features: Features, plan: ShardingPlan, store: RowStore,
                 comm: Communicator, verdicts: Verdicts | None = None) -> None:
        self.features, self.plan, self.store, self.comm = features, plan, store, comm
        # the native preprocess, where this engine's configuration allows it (else None)
        self.native = NativePrepare.of(features, plan, store, comm)
        # the physical tables whose kernels take a dedup of fixed capacity (one process)
        self.padded = frozenset(
            p for p, phys in enumerate(plan.physical)
            if comm.world_size == 1 and phys.id_bound is not None
            and store[p].takes_padded(phys.optimizer))
        self.verdicts = (verdicts if len(self.padded) == len(plan.physical) and plan.physical
                         and store.backend.triton else None)

    def _native(self, features: Any, weights: Any, training: bool, shapes: Shapes,
                template: Any = None) -> Prepared | None:
        """The batch prepared by the native preprocess, or None when it is not a batch of its
        layout (then ``preprocess`` prepares it, and raises its errors)."""
        if self.native is None or weights is not None or template is not None:
            return None
        return self.native.prepare(features, training, shapes)

    def prepare(self, features: Any, weights: Any, training: bool, shapes: Shapes,
                template: Any = None) -> Batch:
        """The batch validated and prepared (``template``: a serving_config to look up through
        instead of the engine's features). Raises on a bad batch; nothing changes then."""
        native = self.native  # (``_native``, inline: every batch)
        prepared = (native.prepare(features, training, shapes)
                    if native is not None and weights is None and template is None else None)
        if prepared is None:
            device, backend = self.store.device, self.store.backend
            if template is None:
                bags = self.features.bags(features, weights, device, backend, shapes,
                                          self.verdicts if training else None)
                tables = self.features.tables
            else:
                bags, tables = self.features.serving_bags(template, features, weights, device,
                                                          backend)
            prepared = preprocess(bags, tables, self.plan, training, backend, self.padded)
        return Batch(self, prepared)

    def staged(self, features: Any, weights: Any,
               training: bool) -> Callable[[], tuple[Batch, Activations | None, Answers]]:
        """The batch validated now, and a function that prepares it (and, with one process,
        looks it up) on the pipeline's worker. A batch the native preprocess takes is prepared
        now (one kernel call per table: its validation)."""
        prepared = self._native(features, weights, training, Shapes.FIX)
        bags = (self.features.bags(features, weights, self.store.device, self.store.backend,
                                   Shapes.FIX, self.verdicts if training else None)
                if prepared is None else None)

        def stage() -> tuple[Batch, Activations | None, Answers]:
            # one thread for the fused kernels here: the caller's model has the cores
            with cpu.single_threaded():
                if prepared is None:
                    assert bags is not None  # (validated when the native preprocess declined)
                    batch = Batch(self, preprocess(bags, self.features.tables, self.plan,
                                                   training, self.store.backend, self.padded))
                else:
                    batch = Batch(self, prepared)
                if self.comm.world_size > 1:  # collectives stay on the caller's thread
                    return batch, None, ()
                with torch.no_grad():
                    return (batch, *batch.lookup())

        return stage
