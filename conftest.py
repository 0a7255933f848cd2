"""pytest's doctest collection (``--doctest-modules`` over ``embcore`` and ``tests``) imports every
module; ``embcore/torchrec.py`` needs the optional ``torchrec`` extra, so without torchrec it is
left out (tests/test_torchrec.py then skips, saying so)."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("torchrec") else ["embcore/torchrec.py"]
# Helpers of tests run in fresh interpreters (they set TRITON_INTERPRET, or patch the package, as
# they are imported): never imported by the doctest collection of this process. Named on a
# command line they are collected as usual.
collect_ignore += ["tests/triton_cases.py", "tests/triton_map_cases.py",
                   "tests/triton_cache_cases.py", "tests/triton_compile_cases.py",
                   "tests/device_map_everywhere.py"]
