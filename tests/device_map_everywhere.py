"""A pytest plugin (``-p device_map_everywhere``): every raw-id map is a ``DeviceVocabMap``.

tests/test_device_map.py runs the raw-id suites with it, in a fresh interpreter with
``TRITON_INTERPRET=1`` (the maps' hash kernels run in Triton's interpreter on the CPU tensors of
those suites' engines; every other kernel is chosen as usual), so that every rule those suites
pin down (admission, eviction, TTL, stacked tables, checkpoints, publish and serving) holds for the
device map too. At exit it prints how many device maps were made (the runner checks there
were some).
"""

from __future__ import annotations

import atexit
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from embcore.kernels import gpu
from embcore.state.vocab import torch_map as id_map
from embcore.state.vocab import vocabulary
from embcore.state.vocab.device_map import DeviceVocabMap

assert gpu.available() and gpu.interpreted(), (
    f"the device map's kernels must load in Triton's interpreter: {gpu.error()}")

MADE = [0]


def _device_map(capacity: int, backend: object, **kwargs) -> id_map.VocabMap:
    MADE[0] += 1
    return DeviceVocabMap(capacity, **kwargs)


vocabulary.vocab_map = _device_map  # (the one factory, where the engine makes its maps)
atexit.register(lambda: print(f"\ndevice maps made: {MADE[0]}"))
