"""pytest's doctest collection (``--doctest-modules`` over ``embcore``) imports every module of the
package; ``embcore/torchrec.py`` needs the optional ``torchrec`` extra, so without torchrec it is
left out (tests/test_torchrec.py then skips, saying so)."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("torchrec") else ["embcore/torchrec.py"]
