"""Example counts of the hypothesis tests under the profile pytest loaded (tests/conftest.py)."""

from __future__ import annotations

from hypothesis import settings

CI_EXAMPLES = 100  # the "ci" and "dev" profiles' max_examples (hypothesis's default)


def examples(n: int) -> int:
    """A test's example count, for ``@settings(max_examples=examples(n))`` (a test's own
    max_examples overrides the profile's): ``n``, the test's cost relative to the others, in "ci"
    and "dev"; ``n`` times the profile's max_examples / CI_EXAMPLES in "thorough" (10 n); never
    fewer than ``n``."""
    return max(n, n * settings.default.max_examples // CI_EXAMPLES)
