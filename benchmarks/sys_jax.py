"""JAX on CPU: one ``jax.jit``-ed step over all tables (lookup, the gradient of the fixed upstream
gradient, the exact Adagrad or row-wise Adagrad update of the touched rows), with the tables and
accumulators donated so XLA updates them in place. Runs in the peers' venv (``jax``, ``jaxlib``).

    .venv-peers/bin/python benchmarks/sys_jax.py --workload W1 [--optimizer rowwise] --json

Update rule, the same as embcore's: per table, the gradients of duplicate ids are summed first,
then for every touched row ``a += g*g; w -= lr * g / sqrt(a)`` (exact Adagrad), or
``a_row += mean(g*g); w -= lr * g / sqrt(a_row)`` (``--optimizer rowwise``, one accumulator per
row); rows not in the batch do not move.

UPDATE selects how the touched rows are updated; both give the same tables (see check below):

- ``"sparse"``: sort the ids, sum the gradients of equal ids (``segment_sum``), gather the U
  unique rows, update them, scatter them back (static shapes: U is padded to B*L with
  out-of-range row numbers, which the scatter drops). Work ~ touched rows.
- ``"dense"``: sum the gradients into a zero (N, D) buffer (``.at[ids].add``) and apply the rule
  to the whole table; an untouched row has g == 0 so ``a += 0; w -= 0`` leaves it bit-identical.
  Work ~ N x D per table and step.

The kept one is SPARSE: see the module's UPDATE comment for the measurements.

Threads: XLA:CPU ignores OMP_NUM_THREADS and has no documented setting for "N intra-op threads"
(``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``, from the JAX
issue tracker, only turns multi-threading off); its Eigen pool defaults to one thread per core,
i.e. 2 on the benchmark machine. Left at XLA's defaults.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np
import torch

import common
from workloads import Batch, Workload

try:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU/TPU probing
    import jax
    import jax.numpy as jnp
except ImportError as e:  # reported as a "not installed" row
    common.not_installed("JAX", "rowwise" if "rowwise" in sys.argv else "adagrad",
                         sys.argv[sys.argv.index("--workload") + 1], e)

UPDATE = os.environ.get("EMB_JAX_UPDATE", "sparse")


def _bag_grads(g: jax.Array, seg: jax.Array | None, scale: jax.Array | None) -> jax.Array:
    """The gradient of each id position: its bag's upstream gradient (times 1/len for mean)."""
    if seg is None:  # bags of one id: position i is bag i
        return g  # (B, D)
    gi = g[seg]  # (B*L, D)
    return gi if scale is None else gi * scale[:, None]


def _lookup(w: jax.Array, ids: jax.Array, seg: jax.Array | None, scale: jax.Array | None,
            batch: int) -> jax.Array:
    rows = w.at[ids].get(mode="promise_in_bounds")  # (B*L, D)
    if seg is None:
        return rows  # (B, D)
    if scale is not None:
        rows = rows * scale[:, None]
    return jax.ops.segment_sum(rows, seg, num_segments=batch, indices_are_sorted=True)  # (B, D)


def _update_dense(w, a, ids, gi, rowwise):
    n = w.shape[0]
    g = jnp.zeros_like(w).at[ids].add(gi, mode="promise_in_bounds")  # (N, D), 0 on untouched rows
    if rowwise:
        a = a + jnp.mean(g * g, axis=1)  # (N,)
        return w - common.LR * g / jnp.sqrt(a)[:, None], a
    del n
    a = a + g * g  # (N, D)
    return w - common.LR * g / jnp.sqrt(a), a


def _update_sparse(w, a, ids, gi, rowwise):
    n, nnz = w.shape[0], ids.shape[0]
    pos = jnp.arange(nnz, dtype=ids.dtype)
    sid, perm = jax.lax.sort((ids, pos), num_keys=1)  # (nnz,) sorted ids and where they came from
    new = jnp.concatenate([jnp.ones((1,), bool), sid[1:] != sid[:-1]])  # first of each run
    useg = jnp.cumsum(new) - 1  # (nnz,) unique slot of each sorted position
    g = jax.ops.segment_sum(gi[perm], useg, num_segments=nnz, indices_are_sorted=True)  # (U*, D)
    # the row of each slot; unused slots get distinct out-of-range rows n, n+1, ... (dropped)
    rows = (n + pos).at[useg].set(sid, indices_are_sorted=True)  # (U*,) sorted, unique
    kw = dict(indices_are_sorted=True, unique_indices=True)
    wu = w.at[rows].get(mode="fill", fill_value=0.0, **kw)  # (U*, D)
    au = a.at[rows].get(mode="fill", fill_value=1.0, **kw)  # (U*, D) or (U*,)
    if rowwise:
        au = au + jnp.mean(g * g, axis=1)
        wu = wu - common.LR * g / jnp.sqrt(au)[:, None]
    else:
        au = au + g * g
        wu = wu - common.LR * g / jnp.sqrt(au)
    return (w.at[rows].set(wu, mode="drop", **kw), a.at[rows].set(au, mode="drop", **kw))


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
        update = _update_sparse if UPDATE == "sparse" else _update_dense
        batch = w.batch

        def step(ws, accs, ids, seg, scale, grads):
            outs, new_ws, new_accs = [], [], []
            for wt, at, it, gt in zip(ws, accs, ids, grads):
                outs.append(_lookup(wt, it, seg, scale, batch))  # (B, D) activations
                gi = _bag_grads(gt, seg, scale)  # (B*L, D) d loss / d row, per id position
                wt, at = update(wt, at, it, gi, rowwise)
                new_ws.append(wt)
                new_accs.append(at)
            return tuple(new_ws), tuple(new_accs), tuple(outs)

        self._step = jax.jit(step, donate_argnums=(0, 1))
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
        self.ws, self.accs, self.out = self._step(self.ws, self.accs, ids, seg, scale,
                                                  self.grads)
        jax.block_until_ready((self.ws, self.accs, self.out))

    def tables(self) -> list[torch.Tensor]:
        # copies: a view of a buffer that the next step donates would change under the caller
        return [torch.from_numpy(np.array(t)) for t in self.ws]

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.ws) + sum(a.nbytes for a in self.accs)


if __name__ == "__main__":
    common.main("JAX", JaxSystem, {"jax": jax.__version__, "update": UPDATE})
