"""The slow tier of tables beyond memory: its files (``files.py``), the write-back cache in
fast memory over them (``cache.py``), the cache's index on the host (``index.py``) or on the
device (``device_index.py``), and the tier written as a log of records (``log.py``)."""
