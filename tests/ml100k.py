"""Where the tests find the MovieLens example and the real MovieLens 100K files.

The data stays outside the repository (its license forbids redistribution): $EMBCORE_ML100K, else
the shared copy beside the checkout; tests that need it skip with the reason when it is absent.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "movielens"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

ML100K = Path(os.environ.get("EMBCORE_ML100K", Path(__file__).parents[2] / "shared/data/ml-100k"))
requires_data = pytest.mark.skipif(
    not (ML100K / "u.data").is_file(),
    reason=f"MovieLens 100K not found at {ML100K} (set EMBCORE_ML100K to the unpacked ml-100k "
           f"directory); its license forbids shipping it with the repository")
