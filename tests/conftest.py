import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))  # tests/strategies.py and the other helpers

from profiles import CI_EXAMPLES  # noqa: E402

# Hypothesis profiles, chosen with hypothesis's own option, e.g. `python -m pytest
# --hypothesis-profile dev` (pytest loads it before it imports the test modules):
#   ci        the default, what `python -m pytest` (CI) runs: derandomized, so every run tries the
#             same examples; no example database, no timing-based health check.
#   dev       random examples, new ones each run (a failure is saved in .hypothesis/ and tried
#             first next time): for finding new cases.
#   thorough  random, ten times ci's examples: run by hand.
# A test's own count is `examples(n)` (tests/profiles.py): n (its cost relative to the others) in
# ci and dev, 10 n in thorough.
settings.register_profile("ci", max_examples=CI_EXAMPLES, derandomize=True, database=None,
                          deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=CI_EXAMPLES, derandomize=False, deadline=None,
                          print_blob=True)
settings.register_profile("thorough", settings.get_profile("dev"), max_examples=10 * CI_EXAMPLES)
settings.load_profile("ci")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_native: needs the fused CPU kernels: skipped where no C++ compiler "
        "is found, failed with the build's error where one is found and the build fails "
        "(tests/native_required.py)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("requires_native") is not None:
        from native_required import require_native
        require_native()
