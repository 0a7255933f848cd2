"""The on-disk formats, one module each: the checkpoint directory (``checkpoint.py``), the publish
directory (``published.py``, its writer's steps ``publish_writer.py``), and the file steps they
share (``files.py``). A format module knows files, names, layouts and checks, and no engine."""
