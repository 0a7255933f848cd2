"""Lookup (the second verb of a step): a prepared batch + the row store -> activations.

For each physical table of the batch, the rows are read where they are held: straight from this
process's store when it holds them all (one process, a replicated table), else fetched from the
processes holding them (exchange.py) and combined here. Either way the activations come from the
one ``combine`` (ops/combine.py). No table is written.
"""

from __future__ import annotations

import torch

from ..base.comm import Communicator
from ..ops.combine import combine
from ..state.store import RowStore
from .exchange import Answers, OwnerRows, fetch_rows
from .preprocess import Prepared


def lookup(prepared: Prepared, store: RowStore,
           comm: Communicator) -> tuple[list[torch.Tensor | None], Answers]:
    """The activations of a batch (a collective when a table is sharded).

    Returns:
        ``(activations, received)``: per feature (flat order) its ``shape + (D,)`` activation, or
        None for a feature not in the batch; and what ``apply_gradients`` needs of the exchange.
    """
    flat: list[torch.Tensor | None] = [None] * prepared.num_features
    received: list[OwnerRows | None] = []
    asked = check_map_steps(prepared, store, comm) if prepared.training else {}
    for tb in prepared.tables:
        if tb.route is None:  # held here: the rows object reads them (a map's step first)
            out, got = store[tb.physical].lookup(tb.bags, tb.dedup, prepared.training,
                                                 tb.segments, comm, asked.get(tb.physical))
            received.append(None if got is None else OwnerRows(*got))
        else:
            rows_u, rows, since = fetch_rows(comm, store.plan.physical[tb.physical], store, tb,
                                             prepared.training, asked.get(tb.physical))  # (U, D)
            out = combine(rows_u, tb.dedup.inverse, tb.bags)  # (R, D)
            received.append(OwnerRows(rows, since))
        d = out.shape[1]
        parts = (out.split_with_sizes(tb.slices.sizes) if len(tb.slices) > 1
                 else (out,))  # (one call: views)
        for s, a in zip(tb.slices, parts):
            flat[s.feature] = a if len(s.shape) == 1 else a.view(*s.shape, d)
    return flat, tuple(received)


def check_map_steps(prepared: Prepared, store: RowStore,
                    comm: Communicator) -> dict[int, list[torch.Tensor]]:
    """Before the map steps of a training batch with two dynamic tables or more (stacked or
    not): checks on every process that none of them fails (``Rows.check_step``: free
    unless a table has more distinct ids than its capacity), so that a batch failing at one
    table changes no map anywhere. With several processes it asks the ids of the batch's
    dynamic tables first (the collectives their lookups would make, whose results it returns
    for them: ``{physical: what each process asked}``) and agrees on the outcome (one small
    all_reduce), so every process raises, before any step, when one would fail."""
    if not store.may_refuse:  # (no table whose step can refuse a batch: nothing to agree on)
        return {}
    dynamic = [tb for tb in prepared.tables if store[tb.physical].may_refuse]
    if len(dynamic) < 2 and (comm.world_size == 1 or not dynamic or dynamic[0].segments is None
                             or len(dynamic[0].segments) < 2):
        return {}  # one table (one process's stack checks its own members: DynamicStack)
    if comm.world_size == 1:
        for tb in dynamic:
            store[tb.physical].check_step([tb.dedup.unique], tb.segments)
        return {}
    asked: dict[int, list[torch.Tensor]] = {}
    tables = {tb.physical: store.plan.physical[tb.physical].tables for tb in dynamic}
    for tb in dynamic:  # what each table's map will step over on this process
        if tb.route is None:  # replicated: every process's ids
            asked[tb.physical] = comm.all_to_all([tb.dedup.unique] * comm.world_size,
                                                 count=(tables[tb.physical], "ids"))
        else:
            asked[tb.physical] = comm.all_to_all(tb.route.send_ids,
                                                 count=(tables[tb.physical], "ids"))
    failure: ValueError | None = None
    try:
        for p, ids in asked.items():
            store[p].check_step(ids)
    except ValueError as e:
        failure = e
    flags = torch.zeros(comm.world_size, dtype=torch.int32, device=store.device)
    flags[comm.rank] = int(failure is not None)
    failed = comm.all_reduce_sum(flags).nonzero().flatten().tolist()
    if failure is not None:
        raise failure
    if failed:
        raise ValueError(
            f"tables {[n for tb in dynamic for n in store.plan.physical[tb.physical].tables]}: "
            f"the training step of a map on process(es) {failed} must admit more new ids than "
            f"its shard holds (that process's error names the table and the counts); every "
            f"process drops this batch, no map changed")
    return asked
