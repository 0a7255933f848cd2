"""The raw-id maps of dynamic tables: one shard's id -> row map, three of a kind (torch ops
``torch_map.py``, the fused CPU kernels ``native_map.py``, the GPU ``device_map.py`` over
``device_hash.py``), tested against ``reference.py``, and a table's shard of them with its
seed and initial values (``vocabulary.py``)."""
