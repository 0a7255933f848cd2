"""The queue of the mid-level API: ``enqueue`` -> ``dequeue`` -> ``apply_gradients``, in order;
and the layer's self-contained ``TrainingStep``.

``StepQueue`` holds the enqueued batches and the training batch awaiting its gradients, and says
exactly what is wrong when a call breaks the order (docs/semantics.md section 6). A refused call
raises before anything changes. With ``pipeline_execution`` a batch may be prepared by a
background worker (``Queued.batch`` is then a Future) and up to two batches may be queued.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .exchange import Answers
from .path import Activations, Batch


@dataclass
class Queued:
    """An enqueued batch: prepared now, or by the pipeline's worker (which, with one process,
    also looks it up); its activations and answers once looked up."""

    training: bool
    batch: Batch | Future[tuple[Batch, Activations | None, Answers]]
    activations: Activations | None = None
    answers: Answers = ()

    def wait(self) -> Batch:
        """The prepared batch, once the background work (if any) is done."""
        if isinstance(self.batch, Future):
            self.batch, self.activations, self.answers = self.batch.result()
        assert isinstance(self.batch, Batch)
        return self.batch

    def look_up(self) -> Activations:
        """Its activations (looked up now unless the worker did)."""
        batch = self.wait()
        if self.activations is None:
            self.activations, self.answers = batch.lookup()
        return self.activations


class StepQueue:
    """Enqueued batches in order, and the training batch that awaits ``apply_gradients``."""

    def __init__(self, pipelined: bool) -> None:
        self.limit = 2 if pipelined else 1
        self._worker: ThreadPoolExecutor | None = None
        self._queue: deque[Queued] = deque()
        self._awaiting: Queued | None = None
        self._last_training: bool | None = None

    def check_room(self) -> None:
        pending = len(self._queue)
        if pending < self.limit:
            return
        if pending == 1:
            raise RuntimeError("enqueue() called again before dequeue() of the batch already "
                               "enqueued; call dequeue() after every enqueue()")
        raise RuntimeError(f"enqueue() called while {pending} batches are enqueued and not "
                           f"yet dequeued, the most pipeline_execution=True holds; call "
                           f"dequeue() (it takes the oldest) before enqueuing another")

    def put(self, training: bool, batch: Batch | None = None,
            background: Callable[[], tuple[Batch, Any, Any]] | None = None) -> None:
        """Queues a ``batch`` prepared now, or by ``background()`` on the pipeline's worker
        (returning ``(batch, activations or None, answers)``)."""
        self.check_room()
        if background is None:
            if batch is None:
                raise TypeError("StepQueue.put needs a batch or a background function")
            self._queue.append(Queued(training, batch))
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embcore")
        self._queue.append(Queued(training, self._worker.submit(background)))

    def take(self) -> Queued:
        """The oldest batch, for ``dequeue``."""
        if not self._queue:
            raise RuntimeError("dequeue() called with nothing enqueued; call enqueue(features) "
                               "first")
        if self._queue[0].training and self._awaiting is not None:
            raise RuntimeError("dequeue() of a training batch before apply_gradients() of the "
                               "previous training batch; call apply_gradients() once per training "
                               "dequeue()")
        item = self._queue.popleft()
        self._last_training = item.training
        if item.training:
            self._awaiting = item
        return item

    def dequeue(self) -> Activations:
        """The oldest batch's activations, looked up now unless the worker did (``take``), as
        the caller's leaves: detached (the kernels' outputs already are: a detach costs a
        microsecond each), requiring grad after a training enqueue. A lookup that raises
        consumes the batch (it awaits no gradients)."""
        item = self.take()
        try:
            activations = item.look_up()
        except BaseException:
            self.discard(item)
            raise
        return [None if a is None else
                (a.detach() if a.requires_grad else a).requires_grad_(item.training)
                for a in activations]

    def awaiting(self) -> Queued:
        """The training batch whose gradients are due, for ``apply_gradients``."""
        if self._awaiting is None:
            raise RuntimeError({
                False: "apply_gradients() after a training=False enqueue: there are no training "
                       "activations to apply gradients to; enqueue with training=True",
                True: "apply_gradients() called twice for one training batch; call it once per "
                      "dequeue()",
                None: "apply_gradients() without a training batch; call enqueue(..., "
                      "training=True) and dequeue() first"}[self._last_training])
        return self._awaiting

    def check_idle(self) -> None:
        """Raises ValueError while a batch is queued or awaits its gradients."""
        if self._queue or self._awaiting is not None:
            raise ValueError("the engine has an enqueued batch or one awaiting apply_gradients(); "
                             "finish the step before moving it")

    def discard(self, item: Queued) -> None:
        """Forgets a batch whose lookup raised: it awaits no gradients."""
        if self._awaiting is item:
            self._awaiting = None

    def applied(self) -> None:
        self._awaiting = None

    def wait_all(self) -> None:
        """Lets the background work of every queued batch finish (it reads the tables)."""
        for item in self._queue:
            item.wait()


def _applied(gradients: Any, warn_on_none: bool) -> None:
    raise AssertionError("unreachable: TrainingStep.apply checks `applied` first")


class TrainingStep:
    """A training batch of ``Embedding.training_step`` (the layer's forward): its activations,
    and ``apply`` its gradients once, whenever they come."""

    def __init__(self, apply: Callable[[Any, bool], str | None], activations: Any) -> None:
        self._apply = apply
        self.activations = activations
        self.applied = False

    def apply(self, gradients: Any, *, warn_on_none: bool = True) -> None:
        """Applies this batch's gradients (as ``Embedding.apply_gradients``), once.

        Raises:
            RuntimeError: applied already. ValueError / TypeError / OverflowError: as
            ``apply_gradients`` (an OverflowError once the step is applied and counted).
        """
        if self.applied:
            raise RuntimeError("this training step's gradients were applied already (a second "
                               "backward through the same forward?)")
        overflow = self._apply(gradients, warn_on_none)
        self.applied = True
        self._apply = _applied  # drop the batch now (the step may outlive it: autograd's ctx)
        if overflow is not None:
            raise OverflowError(overflow)
