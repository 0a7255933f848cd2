"""The backend of a device: which kernels run the step's work there, chosen once.

Three backends, as TorchRec names a table's compute kernel:

- ``"fused CPU"``: the C kernels of ``kernels/cpu/`` (a CPU device where they build and are
  switched on: ``cpu.available()``);
- ``"Triton"``: the Triton kernels of ``kernels/gpu/`` (a CUDA device where triton imports; in
  tests, CPU tensors under Triton's interpreter, ``gpu.force_on_cpu``);
- ``"torch ops"``: torch ops alone, the portable path on any device.

``choose(device)`` is the one rule. The engine asks it when it is made (``print(plan)`` shows the
answer) and when its tables move (``Embedding.to``); the rows builder (state/build.py) hands the
plan's backend to every rows object, raw-id map and cache it makes, and none of them asks again: a
table's kernels are bound once (``TableCombine``, ``TableUpdate``), its map is the backend's kind
(``vocab_map`` of state/vocab/vocabulary.py, the one factory) and its cache's index lives where the
backend runs (docs/semantics.md section 16). Inside a call only what truly varies per call is
checked: a table that autograd or a tracer must see takes the torch ops (``torch.export``,
``torch.compile``), on every backend.

>>> choose(torch.device("meta")).name
'torch ops'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..kernels import cpu, gpu

Name = Literal["fused CPU", "Triton", "torch ops"]
NAMES: tuple[Name, ...] = ("fused CPU", "Triton", "torch ops")


@dataclass(frozen=True)
class Backend:
    """A device's backend (see the module's docstring).

    Attributes:
        name: ``"fused CPU"``, ``"Triton"`` or ``"torch ops"``.
    """

    name: Name

    @property
    def fused_cpu(self) -> bool:
        """Whether the fused CPU kernels run the work (kernels/cpu/)."""
        return self.name == "fused CPU"

    @property
    def triton(self) -> bool:
        """Whether the Triton kernels run the work (kernels/gpu/)."""
        return self.name == "Triton"

    def __str__(self) -> str:
        return self.name


FUSED_CPU, TRITON, TORCH_OPS = (Backend(n) for n in NAMES)


def choose(device: torch.device | str) -> Backend:
    """The backend of ``device``: the fused CPU kernels on a CPU where they are built and
    switched on, Triton where its kernels apply to the device's tensors, else torch ops."""
    device = torch.device(device)
    if device.type == "cpu" and not gpu.usable(torch.empty(0)) and cpu.available():
        return FUSED_CPU
    if device.type != "meta" and gpu.usable(torch.empty(0, device=device)):
        return TRITON
    return TORCH_OPS


def named(name: str) -> Backend:
    """The backend called ``name`` (one of ``NAMES``)."""
    if name not in NAMES:
        raise ValueError(f"backend {name!r}: expected one of {NAMES}")
    return {b.name: b for b in (FUSED_CPU, TRITON, TORCH_OPS)}[name]
