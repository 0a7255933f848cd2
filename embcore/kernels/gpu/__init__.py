"""The GPU kernels, in Triton, one module per concern as the CPU package's (``kernels/cpu/``):

- ``rows.py``: a table's rows: the lookup, and the fused backward + optimizer update (with its
  rules, numbered by ``kernels/rules.py``);
- ``index.py``: the raw-id maps' hash index (find, insert, delete);
- ``init.py``: a dynamic table's new rows' initial values (hash -> uniform -> normal);
- ``move.py``: rows moved between a cache and its pinned slow tier;
- ``batch.py``: a batch's preparation: its ids checked, concatenated and deduplicated;
- ``lang.py``: triton, imported once (the modules above still import without it);
- ``args.py``: each kernel's launch declared, its arguments by name and kind, checked;
- ``ops.py``: the kernels as torch operators (``torch.ops.embcore.*``: schemas, fake
  implementations, the arguments they write), registered when the kernels load;
- ``launch.py``: when the kernels apply, and the wrappers the callers use.

This package holds their public names (``gpu.lookup``, ``gpu.usable``, ...).
"""

from __future__ import annotations

from .launch import (
    available,
    bag_index,
    concat_offsets,
    concat_shift,
    dedup_runs,
    error,
    force_on_cpu,
    hash_delete,
    hash_find,
    hash_insert,
    id_bounds,
    init_rows,
    interpreted,
    jagged_offsets,
    lookup,
    lookup_supported,
    move_rows,
    operators,
    row_gradients,
    sparse_update,
    update_rule,
    update_supported,
    usable,
)

__all__ = ['available', 'bag_index', 'concat_offsets', 'concat_shift', 'dedup_runs', 'error',
           'force_on_cpu', 'hash_delete', 'hash_find', 'hash_insert', 'id_bounds', 'init_rows',
           'interpreted', 'jagged_offsets', 'lookup', 'lookup_supported', 'move_rows',
           'operators', 'row_gradients', 'sparse_update', 'update_rule', 'update_supported',
           'usable']
