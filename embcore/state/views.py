"""The checkpoint view of a store: every logical table's state by key, out and in.

Keys are ``"<table>/parameters"``, ``"<table>/<slot>"`` and, for a dynamic table,
``"<table>/vocabulary/<ids, last_use, frequency, step, seed, pending>"`` (docs/semantics.md
sections 7 and 11). ``state_dict`` gives views of whole logical tables with one process, and
checkpoint shards (``DTensor``: dtensors.py) when sharded; ``load_state_dict`` checks keys and
shapes and converts every value (collectives included) before the first write, then moves each
dynamic table's resident ids to the process owning them now (``DynamicRows.rehome``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ..base.comm import Communicator
from ..config.optimizers import table_slots
from ..numerics.rounding import narrowed_for_load
from ..planning.plan import ShardingPlan
from .changes import ChangedRows
from .dtensors import from_value, to_sharded
from .rows import Rows
from .vocab.vocabulary import PENDING, ROW_STATE, SCALARS, VOCAB, DynamicRows


class RowStore(Protocol):
    """What these functions read of a store (store.py's ``RowStore``)."""

    plan: ShardingPlan
    comm: Communicator
    changes: ChangedRows | None

    def __getitem__(self, p: int) -> Rows: ...
    def member(self, name: str) -> DynamicRows: ...
    def local(self, name: str, key: str = "parameters") -> torch.Tensor: ...
    def pending(self, name: str) -> torch.Tensor: ...


def state_shapes(store: RowStore) -> dict[str, tuple[int, ...]]:
    """``{"<table>/<parameters or slot>": (N, C)}`` of every logical table (a dynamic table's
    vocabulary keys too: ``(N, 1)`` per row state, ``()`` for its step and seed)."""
    out: dict[str, tuple[int, ...]] = {}
    for place in store.plan.tables:
        phys = store.plan.physical[place.physical]
        out[f"{place.name}/parameters"] = (place.rows, place.dim)
        for spec in table_slots(phys.optimizer, phys.dtype):
            out[f"{place.name}/{spec.name}"] = (place.rows, 1 if spec.rowwise else place.dim)
        if store[place.physical].maps:
            for k in ROW_STATE:
                out[f"{place.name}/{VOCAB}{k}"] = (place.rows, 1)
            for k in SCALARS:
                out[f"{place.name}/{VOCAB}{k}"] = ()
    return out


def state_dict(store: RowStore) -> dict[str, Any]:
    """Views of whole logical tables with one process; checkpoint shards when sharded (a
    collective: see ``Embedding.state_dict``)."""
    plan, comm = store.plan, store.comm
    out: dict[str, Any] = {}
    for key, shape in state_shapes(store).items():
        name, slot = key.split("/", 1)
        if not shape:  # a dynamic table's step or seed, the same on every process
            out[key] = store.member(name).scalar(slot[len(VOCAB):])
            continue
        local = store.local(name, slot)
        if comm.world_size == 1:
            out[key] = local
        else:
            place = plan.table(name)
            out[key] = to_sharded(place, plan.physical[place.physical], local, shape[1], comm)
    for place in plan.tables:  # dynamic tables' counted ids (P varies: not a shape)
        if store[place.physical].maps:
            out[f"{place.name}/{VOCAB}{PENDING}"] = store.pending(place.name)
    return out


def load_state_dict(store: RowStore, values: Mapping[str, Any], strict: bool = True,
                    saturate: bool = False) -> None:
    """Copies ``{key: whole tensor or state_dict() value}`` in (``"step"`` is the caller's).

    Keys and shapes are checked and every value is converted (collectives included) before the
    first write: an error changes nothing. A 16-bit table's parameters given wider are narrowed
    as ``ec.load`` narrows them (``narrowed_for_load``: a finite value that would become
    infinite refused, or with ``saturate`` stored as the dtype's largest finite value).

    Raises:
        KeyError: with ``strict``, missing keys; always, unknown keys.
        ValueError: a shape mismatch, negative accumulated squares, or (without ``saturate``)
            parameters beyond a 16-bit table's range, naming the key or table.
    """
    plan = store.plan
    shapes = {**state_shapes(store), "step": ()}
    optional = {f"{p.name}/{VOCAB}{PENDING}" for p in plan.tables
                if store[p.physical].maps}  # (P, 3), any P; absent: counting afresh
    unknown = sorted(set(values) - set(shapes) - optional)
    if unknown:
        raise KeyError(f"unexpected keys {unknown}; this engine has "
                       f"{sorted({*shapes, *optional})}")
    missing = sorted(set(shapes) - set(values))
    if strict and missing:
        raise KeyError(f"missing keys {missing} (load with strict=False for a partial load)")
    for k, v in values.items():
        got = tuple(v.size()) if k != "step" else tuple(torch.as_tensor(v).shape)
        if k in optional:
            if not isinstance(v, torch.Tensor) or v.dim() != 2 or got[1] != 3 or \
                    v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
                raise ValueError(f"{k!r}: must be an integer tensor of shape [P, 3] (ids, "
                                 f"counts, last steps seen), got {getattr(v, 'dtype', '')} "
                                 f"{list(got)}")
        elif got != shapes[k]:
            raise ValueError(f"{k!r}: shape {list(got)} does not match the engine's "
                             f"{list(shapes[k])}")
    values = {k: narrowed_for_load(v, plan.physical[plan.table(k.split("/")[0]).physical].dtype,
                                   k, "load_state_dict", "the state_dict", saturate)
              if k.endswith("/parameters") else v for k, v in values.items()}
    new: dict[str, torch.Tensor] = {}
    for k, v in values.items():
        if k in optional:
            new[k] = v.detach().cpu().to(torch.int64)
        elif k != "step" and shapes[k]:
            name, _ = k.split("/", 1)
            place = plan.table(name)
            new[k] = from_value(place, plan.physical[place.physical], v, store.comm)
    maps = _load_maps(store, values, new)  # dynamic tables: entries rehomed, maps checked
    for k, v in new.items():  # accumulated squares must stay >= 0 (the rules take roots)
        name, slot = k.split("/", 1)
        opt = plan.physical[plan.table(name).physical].optimizer
        spec = next((sp for sp in (opt.slots if opt is not None else ()) if sp.name == slot),
                    None)
        if spec is not None and spec.nonnegative and v.numel() and bool((v < 0).any()):
            raise ValueError(f"{k!r} holds negative values (min {v.min().item()}); "
                             f"{type(opt).__name__}'s {slot} are sums of squares, >= 0")
    for k, v in new.items():
        name, slot = k.split("/", 1)
        if not slot.startswith(VOCAB):
            store.local(name, slot).copy_(v)
    for name, (vmap, seed) in maps.items():
        store.member(name).install(vmap, seed)
    if store.changes is not None and new:
        store.changes.mark_all()


def _load_maps(store: RowStore, values: Mapping[str, Any],
               new: dict[str, torch.Tensor]) -> dict[str, tuple[Any, int | None]]:
    """For each dynamic table in ``values``: moves each resident id's entry (map state,
    parameters, slots) to the process owning it now (a collective when sharded), rewrites
    ``new``'s parameters and slots in place, and returns the checked new maps and seeds."""
    out = {}
    for place in store.plan.tables:
        if not store[place.physical].maps:
            continue
        dyn = store.member(place.name)
        prefix = f"{place.name}/{VOCAB}"
        if not any(k.startswith(prefix) for k in values):
            continue
        missing = [k for k in (*ROW_STATE, "step") if prefix + k not in values]
        if missing:
            raise KeyError(f"table {place.name!r} is dynamic but the state lacks "
                           f"{[prefix + k for k in missing]}")
        rows_state = {k: new.pop(prefix + k)[:, 0] for k in ROW_STATE}
        pending = new.pop(prefix + PENDING, None)
        phys = store.plan.physical[place.physical]
        fills = {sp.name: sp.initial_value for sp in table_slots(phys.optimizer, phys.dtype)}
        floats = {k: new[f"{place.name}/{k}"] for k in ("parameters", *fills)
                  if f"{place.name}/{k}" in new}
        step = int(torch.as_tensor(values[prefix + "step"]))
        seed = int(torch.as_tensor(values[prefix + "seed"])) if prefix + "seed" in values \
            else None
        vmap, moved = dyn.rehome(rows_state, floats, step, place.placement, store.comm,
                                 pending, fills)
        new.update({f"{place.name}/{k}": v for k, v in moved.items()})
        out[place.name] = (vmap, seed)
    return out
