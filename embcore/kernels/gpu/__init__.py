"""The GPU kernels, in Triton, one module per concern as the CPU package's (``kernels/cpu/``):

- ``rows.py``: a table's rows: the lookup, and the fused backward + optimizer update (with its
  rules, numbered by ``kernels/rules.py``);
- ``index.py``: the raw-id maps' hash index (find, insert, delete);
- ``move.py``: rows moved between a cache and its pinned slow tier;
- ``lang.py``: triton, imported once (the modules above still import without it);
- ``launch.py``: when the kernels apply, and the launches (each kernel's arguments by name).

This package holds their public names (``gpu.lookup``, ``gpu.usable``, ...).
"""

from __future__ import annotations

from .launch import (
    available,
    error,
    force_on_cpu,
    hash_delete,
    hash_find,
    hash_insert,
    interpreted,
    lookup,
    lookup_supported,
    move_rows,
    row_gradients,
    sparse_update,
    update_rule,
    update_supported,
    usable,
)

__all__ = ['available', 'error', 'force_on_cpu', 'hash_delete', 'hash_find', 'hash_insert',
           'interpreted', 'lookup', 'lookup_supported', 'move_rows', 'row_gradients',
           'sparse_update', 'update_rule', 'update_supported', 'usable']
