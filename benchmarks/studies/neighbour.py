"""A neighbour process for the contention benchmark (benchmarks/studies/contention.py).

    python benchmarks/studies/neighbour.py busy    # one core kept busy (as `yes > /dev/null`)
    python benchmarks/studies/neighbour.py loader  # a data loader producing the next batches

``loader`` is what sits beside real training: a ``torch.utils.data.DataLoader`` with one worker
process that builds W1-sized batches (26 features x 4096 Zipf ids, numpy, then tensors, as a
parsing and hashing input pipeline would), pickled through the loader's queue to this process,
which takes them as fast as they come (no training step paces it, so it is the heaviest such
neighbour: about one core, split over two processes, with queue wake-ups and memory traffic).
Both print ``ready`` once running and run until killed.
"""

from __future__ import annotations

import sys


def busy() -> None:
    print("ready", flush=True)
    while True:
        pass


def loader() -> None:
    import numpy as np
    import torch

    torch.set_num_threads(1)

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            rng = np.random.default_rng(0)
            while True:
                ranks = rng.zipf(1.05, size=(26, 4096))  # (T, B) Zipf ranks
                ids = torch.from_numpy((ranks * 2654435761) % 100_000)  # hashed into 100k rows
                yield {f"f{t}": ids[t] for t in range(26)}

    it = iter(torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=1,
                                          prefetch_factor=2))
    next(it)
    print("ready", flush=True)
    for _ in it:
        pass


if __name__ == "__main__":
    {"busy": busy, "loader": loader}[sys.argv[1]]()
