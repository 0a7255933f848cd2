"""Lookup (the second verb of a step): a prepared batch + the row store -> activations.

For each physical table of the batch, the rows are read where they are held: straight from this
process's store when it holds them all (one process, a replicated table), else fetched from the
processes holding them (exchange.py) and combined here. Either way the activations come from the
one ``combine`` (ops/combine.py). No table is written.
"""

from __future__ import annotations

import torch

from .comm import Communicator
from .exchange import fetch_rows
from .ops.combine import combine
from .preprocess import Prepared
from .store import RowStore

# Per physical table of a batch, the shard rows each process asked this one for (None when the
# table needed no exchange): the owner side of the gradients' exchange in apply_gradients.
Received = tuple[list[torch.Tensor] | None, ...]


def lookup(prepared: Prepared, store: RowStore,
           comm: Communicator) -> tuple[list[torch.Tensor | None], Received]:
    """The activations of a batch (a collective when a table is sharded).

    Returns:
        ``(activations, received)``: per feature (flat order) its ``shape + (D,)`` activation, or
        None for a feature not in the batch; and what ``apply_gradients`` needs of the exchange.
    """
    flat: list[torch.Tensor | None] = [None] * prepared.num_features
    received: list[list[torch.Tensor] | None] = []
    for tb in prepared.tables:
        if tb.route is None:  # every row held here: read them straight from the store
            out = store.combine(tb.physical, tb.bags.ids, tb.bags)  # (R, D)
            received.append(None)
        else:
            rows, got = fetch_rows(comm, store.plan.physical[tb.physical], store, tb)  # (U, D)
            out = combine(rows, tb.dedup.inverse, tb.bags)  # (R, D)
            received.append(got)
        for s in tb.slices:
            flat[s.feature] = out[s.start:s.start + s.rows].view(*s.shape, out.shape[1])
    return flat, tuple(received)
