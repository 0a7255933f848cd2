"""The jobs' metrics in TensorBoard: ``--tensorboard DIR`` writes each metrics.jsonl record as
scalars there too (``tensorboard --logdir DIR`` shows them).

Needs the tensorboard package (``pip install tensorboard``, or the examples' extras); asking
for it without the package is an error at the start, not at the first record.

A record ``{"kind": "eval", "step": 400, "test_auc": 0.79, ...}`` becomes the scalar
``eval/test_auc`` at step 400: every finite number of the record but the step itself, booleans
and the fields a job leaves out, under its kind's name. A resumed job writes its whole history
again, from its first step, and TensorBoard hides what the run before it had written from that
step on (``purge_step``): the curves show each step once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

INSTALL = "pip install tensorboard  (or: pip install -e \".[examples]\")"


class Board:
    """Scalars to TensorBoard. ``Board(None)`` writes nothing (no ``--tensorboard``)."""

    def __init__(self, directory: Path | None, *, step: str = "step", kind: str = "metrics",
                 skip: tuple[str, ...] = ()):
        """``step``: the records' field that is TensorBoard's step; ``kind``: the tags' prefix
        for records without a ``"kind"``; ``skip``: fields not plotted."""
        self.directory, self.step, self.kind = directory, step, kind
        self.skip = {step, *skip}
        self.done = 0  # records of the history written so far
        self.writer: Any = None
        self._layout: dict[str, Any] = {}
        if directory is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise SystemExit(f"--tensorboard {directory}: the tensorboard package is not "
                                 f"installed ({e}); {INSTALL}") from None
            self._writer_type = SummaryWriter
            try:  # (a directory that cannot be one fails here, not at the first record)
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise SystemExit(f"--tensorboard {directory}: cannot be a directory "
                                 f"({e.strerror})") from None

    def together(self, title: str, tags: list[str]) -> None:
        """Draws ``tags`` on one chart, ``title``, in TensorBoard's custom scalars tab."""
        if self.directory is not None:
            self._layout = {self.kind: {title: ["Multiline", tags]}}

    def write(self, history: list[dict[str, Any]]) -> None:
        """The records of ``history`` not written yet (a history only grows)."""
        if self.directory is None or self.done >= len(history):
            return
        new = history[self.done:]
        if self.writer is None:  # the first write: hide what an earlier run wrote from here on
            self.writer = self._writer_type(str(self.directory),
                                            purge_step=int(new[0].get(self.step, 0)))
            if self._layout:
                self.writer.add_custom_scalars(self._layout)
        for record in new:
            step = int(record[self.step])
            for name, value in record.items():
                if name in self.skip or isinstance(value, bool):
                    continue
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"{record.get('kind', self.kind)}/{name}", value, step)
        self.writer.flush()
        self.done = len(history)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
