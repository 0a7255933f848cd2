"""The fused CPU kernels (``csrc/``): built on first use, loaded with ctypes.

The kernels are plain C++ (their own small thread pool, no OpenMP runtime, no torch headers),
so they build in a few seconds with the system's C++ compiler and do not depend on torch's C++
ABI. ``csrc/kernels.cpp`` includes the kernels' headers (``csrc/*.h``, one per concern): one
translation unit, one compiler call, one library. The first call compiles it into a cache
(``$XDG_CACHE_HOME/embcore``, else ``~/.cache/embcore``, else the temp directory), keyed by every
source file, the flags (``ABI_VERSION`` among them), the compiler and this CPU; later processes
load the cached library. Where no compiler works, ``available`` is False, a ``RuntimeWarning``
says why once, and every caller uses its torch-ops twin (same results, slower).

The kernels are grouped by concern, a module each beside its C header: ``library.py`` (the
build, the load, the switch, the threads), ``batch.py`` (dedup, lookup, rows), ``update.py``
(the sparse update, 16-bit rounding), ``ids.py`` (raw ids: hashing dedup, the id maps) and
``cache.py`` (the cache index); this package holds their public names (``cpu.lookup``, ...).

Every C function is declared once, in its module next to its wrapper, as a list of its arguments
by name and kind (args.py: ``read(I64)``, a contiguous CPU int64 tensor the kernel reads;
``INT64``, a scalar; ...): the ctypes signature and the checks of every call come from that
list. A tensor of the wrong dtype, layout, device or length is a ``TypeError`` /
``ValueError`` naming the kernel and the argument, raised before the kernel runs. The values
inside index tensors (ids within the table, offsets within the ids) are the callers' contract:
they are checked where the inputs come in (``inputs/canonical.py``, ``ConcatDedup``'s limits),
not on every call.

Every wrapper takes and returns torch tensors and is tested against ``ops/reference.py`` and
``ops/reference_optim.py``. ``set_enabled(False)`` switches the kernels off for this process
(tests use it to exercise the torch-ops path).
"""

from __future__ import annotations

from ..hyper import Hyper
from .batch import (
    COMBINERS,
    ConcatDedup,
    TableLookup,
    bag_of,
    combiner_scales,
    concat,
    concat_dedup,
    copy_rows,
    copy_rows_summed,
    dedup,
    expand,
    first_unordered,
    lookup,
    minmax,
    offsets_error,
    will_need,
)
from .cache import (
    cache_step,
    row_versions,
    set_flags,
)
from .ids import (
    MAP_FIELDS,
    VOCAB_INFO,
    dedup_raw,
    dedup_raw_runs,
    init_normal,
    map_fields,
    map_fields_seed,
    vocab_find,
    vocab_find_many,
    vocab_grow,
    vocab_index,
    vocab_split,
    vocab_step,
    vocab_step_many,
    vocab_valid,
)
from .library import (
    ABI_VERSION,
    ARCH,
    CSRC,
    DEFINES,
    FLAGS,
    SOURCE,
    available,
    enabled,
    error,
    main,
    set_enabled,
    single_threaded,
    threads,
    usable,
)
from .update import (
    ADAGRAD,
    ROWWISE_ADAGRAD,
    SGD,
    UPDATE_ROW_TYPES,
    SparseUpdate,
    round16,
    sparse_update,
)

__all__ = [
    'ABI_VERSION',
    'ADAGRAD',
    'ARCH',
    'COMBINERS',
    'CSRC',
    'ConcatDedup',
    'DEFINES',
    'FLAGS',
    'Hyper',
    'MAP_FIELDS',
    'ROWWISE_ADAGRAD',
    'SGD',
    'SOURCE',
    'SparseUpdate',
    'TableLookup',
    'UPDATE_ROW_TYPES',
    'VOCAB_INFO',
    'available',
    'bag_of',
    'cache_step',
    'combiner_scales',
    'concat',
    'concat_dedup',
    'copy_rows',
    'copy_rows_summed',
    'dedup',
    'dedup_raw',
    'dedup_raw_runs',
    'enabled',
    'error',
    'expand',
    'first_unordered',
    'init_normal',
    'lookup',
    'main',
    'map_fields',
    'map_fields_seed',
    'minmax',
    'offsets_error',
    'round16',
    'row_versions',
    'set_enabled',
    'set_flags',
    'single_threaded',
    'sparse_update',
    'threads',
    'usable',
    'vocab_find',
    'vocab_find_many',
    'vocab_grow',
    'vocab_index',
    'vocab_split',
    'vocab_step',
    'vocab_step_many',
    'vocab_valid',
    'will_need',
]
