"""Exchange (sharded tables): rows from their holders for the lookup, gradients to their owners.

The data path of sharded tables (docs/semantics.md section 5) as two functions over one physical
table's batch, called by the lookup and apply_gradients verbs once per sharded physical table per
step, every process calling them in the same order:
- ``fetch_rows``: each process sends its unique ids to the ranks holding them (``Route``), each
  holder answers with the rows, and the requester puts them back in unique order (for a column
  split it asks every rank and concatenates the column slices).
- ``gradients_at_owner``: the same exchange backwards with the unique rows' gradients; each owner
  sums what all processes sent for a row (in rank order: deterministic) and updates it once.
  Replicated tables instead sum a dense gradient and a touched mask with ``all_reduce``.
All collectives go through ``comm`` (and time out there), each counted as the table's ids,
rows or gradients (``Embedding.exchange_stats``). With a compressed exchange
(``comm.codec``: codec.py) rows and gradients travel encoded; ids always travel exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base.comm import Communicator
from ..planning.plan import PhysicalTable
from ..state.store import RowStore
from .codec import Wire
from .preprocess import TableBatch


@dataclass(frozen=True)
class OwnerRows:
    """The owner side of one physical table's lookup, for the gradients' exchange: per asking
    process, the shard rows this process answered with (a dynamic table's raw ids resolved by
    its map), and the map step they are valid at (None: a static table)."""

    rows: list[torch.Tensor]
    since: int | None = None


# Per physical table of a batch, what this process answered (None when the table needed no
# exchange and no map): the owner side of apply_gradients.
Answers = tuple[OwnerRows | None, ...]


def fetch_rows(comm: Communicator, p: PhysicalTable, store: RowStore, tb: TableBatch,
               training: bool, asked: list[torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, list[torch.Tensor], int | None]:
    """The (U, D) rows of ``tb.dedup.unique`` from their holders.

    Args:
        comm: the communicator.
        p: the physical table's plan.
        store: this process's rows (answers what the others ask for).
        tb: this rank's batch for the table (``tb.route`` says where each distinct row lives).
        training: whether a dynamic table's map takes a training step (admission).
        asked: what each process asked this one for, when it was exchanged already (the
            lookup's check of a batch's map steps); None: exchanged here.

    Returns:
        ``(rows (U, D), answered, since)``: ``answered[s]`` holds the shard rows this rank read
        for rank s (the owner side of the later gradient exchange), and ``since`` the map step
        they are valid at (None: not a dynamic table).
    """
    rt = tb.route
    assert rt is not None, "a sharded table's batch is routed"
    if asked is None:
        asked = comm.all_to_all(rt.send_ids, count=(p.tables, "ids"))  # asked of this rank
    rows_here = store[p.index]
    if rows_here.may_refuse:  # (raw ids: an owner's map step may refuse the batch)
        return _fetch_mapped(comm, p, store, tb, asked, training)
    answered, since = rows_here.resolve(asked, training)
    answers = [rows_here.gather(rows) for rows in answered]  # W x (n_s, D_r)
    dtype = p.rows_dtype  # (an 8-bit table's rows gathered widened)
    wire = comm.codec.rows_wire(dtype) if comm.codec is not None else None
    if p.placement.splits_columns:
        widths = [c1 - c0 for c0, c1 in p.columns]
        back = _rows_to_all(comm, wire, answers, rt.counts, widths, dtype,
                            p.tables)  # W x (U, D_d)
        return torch.cat(back, dim=1), answered, since
    back = _rows_to_all(comm, wire, answers, rt.counts, None, dtype, p.tables)  # W x (n_d, D)
    rows = torch.empty(tb.dedup.unique.numel(), p.dim, dtype=back[0].dtype,
                       device=back[0].device)  # (U, D)
    assert rt.order is not None
    rows[rt.order] = torch.cat(back)
    return rows, answered, since


def _fetch_mapped(comm: Communicator, p: PhysicalTable, store: RowStore, tb: TableBatch,
                  asked: list[torch.Tensor], training: bool
                  ) -> tuple[torch.Tensor, list[torch.Tensor], int | None]:
    """``fetch_rows`` of a raw-id table (rows, never a column split). Its owners' maps resolve
    the raw ids, and a training step can fail on one owner (more ids to admit than its shard
    holds): every answer carries one more row, a status (1 in its first column: the owner's
    step failed), so that every process raises a ``ValueError`` at this table instead of the
    others waiting on the failed one until their collectives time out."""
    rt = tb.route
    assert rt is not None
    failure: ValueError | None = None
    rows_here = store[p.index]
    try:
        answered, since = rows_here.resolve(asked, training)  # raw ids -> rows
    except ValueError as e:  # nothing changed here; the other processes learn it below
        failure, answered, since = e, [], None
    table = rows_here.table
    dtype = p.rows_dtype  # (an 8-bit table's rows gathered widened)
    answers = []
    for s, ids in enumerate(asked):
        n = ids.numel() - rt.header  # (a stack's ids come after the count of each member's)
        out = torch.empty(n + 1, table.shape[1], dtype=dtype,
                          device=table.device)  # (n_s + 1, D): the rows, then the status
        if failure is None:
            rows_here.gather(answered[s], out=out[:-1])
            out[-1] = 0
        else:
            out.zero_()
            out[-1, 0] = 1
        answers.append(out)
    wire = comm.codec.rows_wire(dtype) if comm.codec is not None else None
    back = _rows_to_all(comm, wire, answers, [c + 1 for c in rt.counts], None,
                        dtype, p.tables)  # W x (n_d + 1, D); (a status of 1: non-zero)
    if failure is not None:
        raise failure
    status = torch.stack([b[-1, 0] for b in back])  # (W,)
    if bool(status.any()):
        failed = status.nonzero().squeeze(1).tolist()
        raise ValueError(
            f"tables {list(p.tables)}: the training step of the map on process(es) {failed} "
            f"must admit more new ids than its shard holds (that process's error says how "
            f"many); every process drops this batch")
    rows = torch.empty(tb.dedup.unique.numel(), p.dim, dtype=dtype,
                       device=table.device)  # (U, D)
    assert rt.order is not None
    rows[rt.order] = torch.cat([b[:-1] for b in back])
    return rows, answered, since


def gradients_at_owner(comm: Communicator, p: PhysicalTable, tb: TableBatch,
                       answered: list[torch.Tensor] | None,
                       g_unique: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sends each unique row's gradient to its holder(s).

    Args:
        answered: the shard rows this rank answered for each rank at the lookup (None when the
            table needed no exchange: one process, or replicated; a dynamic table held here
            passes its resolved rows of ``tb.dedup.unique`` as one tensor).
        g_unique: (U, D) this rank's summed gradient of each of its unique rows.

    Returns:
        (rows (M,), grads (M, D)): the shard rows this rank updates, each once, with their
        gradients summed over every process's occurrences.
    """
    device = g_unique.device
    rt = tb.route
    if rt is None:  # held here: the unique rows (a dynamic table's: as its map resolved them)
        unique = answered[0] if answered is not None else tb.dedup.unique
        if comm.world_size == 1:  # rows are this shard's rows already, each once
            return unique, g_unique
        # replicated: sum the dense gradient and the touched mask over ranks
        n = p.stored_rows  # (a dynamic table's zero row too)
        dense = torch.zeros(n, p.dim, dtype=g_unique.dtype, device=device)  # (N_p, D)
        dense.index_add_(0, unique, g_unique)
        touched = torch.zeros(n, dtype=g_unique.dtype, device=device)  # (N_p,)
        touched[unique] = 1.0
        comm.all_reduce_sum(dense, count=(p.tables, "gradients"))
        comm.all_reduce_sum(touched, count=(p.tables, "gradients"))
        rows = touched.nonzero().squeeze(1)
        return rows, dense[rows]
    assert answered is not None, "fetch_rows recorded what each rank asked for"
    wire = comm.codec.gradients_wire(g_unique.dtype) if comm.codec is not None else None
    if wire is not None:
        got = _gradients_to_all(comm, wire, p, tb, answered, g_unique)
    elif p.placement.splits_columns:
        chunks = [g_unique[:, c0:c1] for c0, c1 in p.columns]  # W x (U, D_d)
        c0, c1 = p.columns[comm.rank]
        got = comm.all_to_all(chunks, [t.numel() for t in answered], c1 - c0,
                              count=(p.tables, "gradients"))
    else:
        g_sorted = g_unique[rt.order]  # (U, D) in send order
        got = comm.all_to_all(list(g_sorted.split(rt.counts)), [t.numel() for t in answered],
                              count=(p.tables, "gradients"))
    ids = torch.cat(answered)  # (M,) shard rows, per source rank
    rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    g = torch.zeros(rows.numel(), got[0].shape[1], dtype=g_unique.dtype, device=device)
    return rows, g.index_add_(0, inverse, torch.cat(got))  # summed in rank order


def _rows_to_all(comm: Communicator, wire: Wire | None, chunks: list[torch.Tensor],
                 rows: list[int], cols: list[int] | None, dtype: torch.dtype,
                 tables: tuple[str, ...]) -> list[torch.Tensor]:
    """``comm.all_to_all`` of row chunks (``cols``: the width each rank sends here; None: this
    rank's), through ``wire`` when the forward exchange is compressed (rows of ``dtype``), counted
    as the rows of ``tables``."""
    if wire is None:
        return comm.all_to_all(chunks, rows, cols, count=(tables, "rows"))
    widths = cols if cols is not None else [chunks[0].shape[1]] * comm.world_size
    got = comm.all_to_all([wire.encode(c) for c in chunks], rows,
                          [wire.width(w) for w in widths], count=(tables, "rows"))
    return [wire.decode(g, w, dtype) for g, w in zip(got, widths)]


def _gradients_to_all(comm: Communicator, wire: Wire, p: PhysicalTable, tb: TableBatch,
                      answered: list[torch.Tensor], g_unique: torch.Tensor
                      ) -> list[torch.Tensor]:
    """``gradients_at_owner``'s exchange through ``wire`` (the backward is compressed, with the
    codec's error feedback): what each rank sent here, decoded."""
    assert comm.codec is not None and tb.route is not None
    rt, d = tb.route, g_unique.shape[1]
    if p.placement.splits_columns:
        chunks = comm.codec.gradients(wire, p.index, tb.dedup.unique, tb.segments, g_unique,
                                      list(p.columns))  # W x (U, width(D_d))
        c0, c1 = p.columns[comm.rank]
        d = c1 - c0
    else:
        (encoded,) = comm.codec.gradients(wire, p.index, tb.dedup.unique, tb.segments,
                                          g_unique)  # (U, width(D))
        chunks = list(encoded[rt.order].split(rt.counts))
    got = comm.all_to_all(chunks, [t.numel() for t in answered], wire.width(d),
                          count=(p.tables, "gradients"))
    return [wire.decode(g, d, g_unique.dtype) for g in got]
