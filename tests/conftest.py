"""Shared pytest setup: hypothesis profile and multi-rank world cleanup.

Multi-rank tests do ``from world import run_on_world`` (``tests/`` is on sys.path).
"""

from hypothesis import HealthCheck, settings

import world

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow],
    derandomize=False, print_blob=True,
)
settings.load_profile("ci")


def pytest_sessionfinish(session, exitstatus):
    world.shutdown_worlds()  # workers leave their process groups before exit
