"""JAX on CPU: one ``jax.jit``-ed step over all tables (lookup, the gradient of the fixed upstream
gradient, the exact Adagrad or row-wise Adagrad update of the touched rows), with the tables,
accumulators and a per-table workspace donated so that XLA updates them in place. Runs in the
peers' venv (``jax``, ``jaxlib``).

    .venv-peers/bin/python benchmarks/systems/sys_jax.py --workload W1 [--optimizer rowwise] --json

Update rule, the same as embcore's: per table, the gradients of duplicate ids are summed first,
then for every touched row ``a += g*g; w -= lr * g / sqrt(a)`` (exact Adagrad), or
``a_row += mean(g*g); w -= lr * g / sqrt(a_row)`` (``--optimizer rowwise``, one accumulator per
row); rows not in the batch do not move. The activations are computed and returned by the jitted
step (otherwise XLA would drop the lookup), and ``step`` blocks until everything is done.

Sparse update, kept over a dense one: equal ids share one slot (see ``_step_table``), the unique
rows are gathered, updated and scattered back; work ~ ids per step. Tried on W3, both variants
interleaved in one process (ms/step; this 2-core machine was shared, so the spread is large):
W3-B16 sparse 0.23-0.26, dense 0.45-0.60; W3-B1024 sparse 0.63-0.91, dense 0.62-0.91 (within 3%
of each other in every pairing: a tie). Dense = sum the gradients into a zero (N, D) buffer with
``.at[ids].add`` and apply the rule to the whole table (g == 0 leaves untouched rows
bit-identical); on W1 it would stream 26 x 100k x 64 floats several times a step. A first sparse
version found the unique ids with ``lax.sort`` + ``jnp.cumsum``: W3-B1024 1.4 ms (XLA:CPU's sort
is slow, and cumsum lowers to a reduce-window); reading the lookup with a separate ``w[ids]``
made XLA copy each donated table every step.

Threads: XLA:CPU ignores OMP_NUM_THREADS and has no documented setting for "N intra-op threads"
(``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``, from the JAX
issue tracker, only turns multi-threading off); its Eigen pool has one thread per core, i.e. 2 on
the benchmark machine. Left at XLA's defaults.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # common, workloads
import common  # noqa: E402
from workloads import Batch, Workload  # noqa: E402

try:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU/TPU probing
    import jax
    import jax.numpy as jnp
except ImportError as e:  # reported as a "not installed" row
    common.not_installed("JAX", "rowwise" if "rowwise" in sys.argv else "adagrad",
                         sys.argv[sys.argv.index("--workload") + 1], e)


def _combine(rows: jax.Array, seg: jax.Array | None, scale: jax.Array | None,
             batch: int) -> jax.Array:
    """The activations from the looked-up row of each id position: (B*L, D) -> (B, D)."""
    if seg is None:  # bags of one id: position i is example i
        return rows
    if scale is not None:
        rows = rows * scale[:, None]
    return jax.ops.segment_sum(rows, seg, num_segments=batch, indices_are_sorted=True)


def _position_grads(g: jax.Array, seg: jax.Array | None, scale: jax.Array | None) -> jax.Array:
    """d loss / d row of each id position: its bag's upstream gradient (/ bag length for mean)."""
    if seg is None:
        return g  # (B, D)
    gi = g[seg]  # (B*L, D)
    return gi if scale is None else gi * scale[:, None]


def _rule(w, a, g, rowwise):
    """Adagrad / row-wise Adagrad on rows ``w`` (R, D) with summed gradients ``g`` (R, D)."""
    if rowwise:
        a = a + jnp.mean(g * g, axis=1)  # (R,)
        return w - common.LR * g / jnp.sqrt(a)[:, None], a
    a = a + g * g  # (R, D)
    return w - common.LR * g / jnp.sqrt(a), a


_IN = dict(mode="promise_in_bounds")


def _step_table(w, a, last, ids, seg, scale, g, batch, rowwise):
    """Sum the gradients of equal ids into one slot per unique id, update those rows, scatter
    them back. No sort (XLA:CPU's sort is slow) and no (N, D) buffer: ``last`` (N,) int32 keeps,
    for each id of this batch, one position holding it (a scatter with duplicates keeps one of
    them; entries of ids not in the batch are stale and never read), so equal ids share a slot.
    The lookup reads the gathered unique rows: the table's only reader then feeds its scatter,
    and XLA updates the donated table in place (a separate ``w[ids]`` makes it copy the table)."""
    n, nnz = w.shape[0], ids.shape[0]
    pos = jnp.arange(nnz, dtype=ids.dtype)
    last = last.at[ids].set(pos, **_IN)  # (N,)
    rep = last.at[ids].get(**_IN)  # (nnz,) the slot of each position: a position with its id
    gi = _position_grads(g, seg, scale)  # (nnz, D)
    gu = jax.ops.segment_sum(gi, rep, num_segments=nnz)  # (nnz, D) summed per slot; 0 elsewhere
    # the row of each slot; unused slots get distinct out-of-range rows n + slot (dropped)
    rows = (n + pos).at[rep].set(ids, **_IN)  # (nnz,) unique
    kw = dict(unique_indices=True)
    wu = w.at[rows].get(mode="fill", fill_value=0.0, **kw)  # (nnz, D)
    au = a.at[rows].get(mode="fill", fill_value=1.0, **kw)  # (nnz, D) or (nnz,)
    out = _combine(wu.at[rep].get(**_IN), seg, scale, batch)  # (B, D)
    wu, au = _rule(wu, au, gu, rowwise)
    return (out, w.at[rows].set(wu, mode="drop", **kw), a.at[rows].set(au, mode="drop", **kw),
            last)


class JaxSystem:
    def __init__(self, w: Workload, optimizer: str, grads: list[torch.Tensor],
                 init: list[torch.Tensor] | None) -> None:
        self.w = w
        rowwise = optimizer == "rowwise"
        if init is None:  # a fixed seed; the timing does not depend on the values
            init = [torch.rand(w.rows, w.dim, generator=torch.Generator().manual_seed(t)) * 0.2
                    - 0.1 for t in range(w.tables)]
        self.ws = tuple(jnp.asarray(t.detach().numpy(), dtype=jnp.float32) for t in init)
        shape = (w.rows,) if rowwise else (w.rows, w.dim)
        self.accs = tuple(jnp.full(shape, common.ACC0, jnp.float32) for _ in range(w.tables))
        self.grads = tuple(jnp.asarray(g.numpy(), dtype=jnp.float32) for g in grads)  # T x (B, D)
        # _step_table's workspace, (N,) int32 per table; not optimizer state, not in state_bytes
        self.lasts = tuple(jnp.zeros((w.rows,), jnp.int32) for _ in range(w.tables))
        batch = w.batch

        def step(ws, accs, lasts, ids, seg, scale, grads):
            outs, new_ws, new_accs, new_lasts = [], [], [], []
            for wt, at, lt, it, gt in zip(ws, accs, lasts, ids, grads):
                out, wt, at, lt = _step_table(wt, at, lt, it, seg, scale, gt, batch, rowwise)
                outs.append(out)  # (B, D) activations
                new_ws.append(wt)
                new_accs.append(at)
                new_lasts.append(lt)
            return tuple(new_ws), tuple(new_accs), tuple(new_lasts), tuple(outs)

        self._step = jax.jit(step, donate_argnums=(0, 1, 2))
        self.out = None

    def prepare(self, batch: Batch) -> tuple:
        ids = tuple(jnp.asarray(i.numpy().astype(np.int32)) for i in batch.ids)  # T x (B*L,)
        if self.w.bag == 1:
            return ids, None, None
        off = batch.offsets.numpy()
        lens = np.diff(off)  # (B,)
        seg = np.repeat(np.arange(self.w.batch, dtype=np.int32), lens)  # (B*L,) bag of each id
        scale = None
        if self.w.combiner == "mean":
            scale = jnp.asarray((1.0 / np.maximum(lens, 1))[seg].astype(np.float32))  # (B*L,)
        return ids, jnp.asarray(seg), scale

    def step(self, native: tuple) -> None:
        ids, seg, scale = native
        self.ws, self.accs, self.lasts, self.out = self._step(
            self.ws, self.accs, self.lasts, ids, seg, scale, self.grads)
        jax.block_until_ready((self.ws, self.accs, self.lasts, self.out))

    def tables(self) -> list[torch.Tensor]:
        # copies: a view of a buffer that the next step donates would change under the caller
        return [torch.from_numpy(np.array(t)) for t in self.ws]

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.ws) + sum(a.nbytes for a in self.accs)


if __name__ == "__main__":
    common.main("JAX", JaxSystem, {"jax": jax.__version__})
