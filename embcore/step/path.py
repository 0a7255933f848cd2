"""A step's path: the three verbs (prepare, lookup, apply) behind one small interface.

``StepPath`` is what the engine calls; a ``Batch`` remembers the path that prepared it, so the
choice of path is made once per batch, at ``prepare``, and the batch's lookup and apply go where
it went. Two paths implement it:

- ``GeneralPath`` (here): every batch, over the verbs ``preprocess`` (preprocess.py),
  ``lookup`` (lookup.py) and ``apply_step`` (gradients.py): any input kind, weights, placement,
  store and optimizer, one process or many.
- ``FastPath`` (fast.py): one kernel call per verb and physical table for batches of dense
  one-id features on the tables of one CPU process (raw-id tables: their maps' step first); it
  hands whatever it does not cover to the general path, which then raises its errors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..base.comm import Communicator
from ..inputs.features import Features, Shapes
from ..ops import native
from ..planning.plan import ShardingPlan
from ..state.store import RowStore
from .exchange import Answers
from .gradients import apply_step
from .lookup import lookup
from .preprocess import Prepared, preprocess

Activations = list[torch.Tensor | None]  # per feature (flat order): its activation, or None


class StepPath(Protocol):
    """The verbs of a step over one engine's features, plan and rows (``store``)."""

    store: RowStore

    def prepare(self, features: Any, weights: Any, training: bool, shapes: Shapes,
                template: Any = None) -> Batch:
        """The batch validated and prepared (``template``: a serving_config to look up through
        instead of the engine's features). Raises on a bad batch; nothing changes then."""

    def staged(self, features: Any, weights: Any,
               training: bool) -> Callable[[], tuple[Batch, Activations | None, Answers]]:
        """The batch validated now, and a function that prepares it (and, with one process,
        looks it up) on the pipeline's worker."""

    def lookup(self, prepared: Prepared) -> tuple[Activations, Answers]:
        """Per feature its ``shape + (D,)`` activation, and what the apply needs of the
        exchange (a collective when a table is sharded)."""

    def apply(self, prepared: Prepared, answers: Answers, grads: Sequence[object], step: int,
              warn_on_none: bool, before_write: Callable[[], None]) -> None:
        """Checks the flat gradients and evaluates multipliers and learning rates (raising
        before any write), calls ``before_write()``, then updates the batch's rows."""


@dataclass(frozen=True)
class Batch:
    """A prepared batch and the path that prepared it (the one that looks it up and applies
    its gradients)."""

    path: StepPath
    prepared: Prepared

    def lookup(self) -> tuple[Activations, Answers]:
        return self.path.lookup(self.prepared)

    def apply(self, answers: Answers, grads: Sequence[object], step: int, warn_on_none: bool,
              before_write: Callable[[], None]) -> None:
        self.path.apply(self.prepared, answers, grads, step, warn_on_none, before_write)


class GeneralPath:
    """The three verbs for every batch (see the module's docstring).

    Args:
        features: the engine's features (their shapes are read and fixed as ``Shapes`` says).
        plan, store, comm: the engine's plan, rows and communicator.
    """

    def __init__(self, features: Features, plan: ShardingPlan, store: RowStore,
                 comm: Communicator) -> None:
        self.features, self.plan, self.store, self.comm = features, plan, store, comm

    def prepare(self, features: Any, weights: Any, training: bool, shapes: Shapes,
                template: Any = None) -> Batch:
        device = self.store.device
        if template is None:
            bags = self.features.bags(features, weights, device, shapes)
            tables = self.features.tables
        else:
            bags, tables = self.features.serving_bags(template, features, weights, device)
        return Batch(self, preprocess(bags, tables, self.plan, training))

    def staged(self, features: Any, weights: Any,
               training: bool) -> Callable[[], tuple[Batch, Activations | None, Answers]]:
        bags = self.features.bags(features, weights, self.store.device, Shapes.FIX)

        def stage() -> tuple[Batch, Activations | None, Answers]:
            # one thread for the fused kernels here: the caller's model has the cores
            with native.single_threaded():
                batch = Batch(self, preprocess(bags, self.features.tables, self.plan, training))
                if self.comm.world_size > 1:  # collectives stay on the caller's thread
                    return batch, None, ()
                with torch.no_grad():
                    return (batch, *self.lookup(batch.prepared))

        return stage

    def lookup(self, prepared: Prepared) -> tuple[Activations, Answers]:
        return lookup(prepared, self.store, self.comm)

    def apply(self, prepared: Prepared, answers: Answers, grads: Sequence[object], step: int,
              warn_on_none: bool, before_write: Callable[[], None]) -> None:
        apply_step(prepared, answers, grads, self.features.names, self.store, self.comm, step,
                   warn_on_none, before_write)
