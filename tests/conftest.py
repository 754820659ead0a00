"""Test-suite wide fixtures: the real brokers (harness/brokers.py) and a federation over the
loopback broker (tests/loopback_runs.py); and the order the suite runs in."""

from harness.brokers import amqtt_broker, any_broker, mosquitto  # noqa: F401  (fixtures)
from loopback_runs import federation, quiet_torch  # noqa: F401  (fixtures)

WHOLE_RUNS = ("tests/e2e/", "tests/integration/")
"""Where the long files are: whole runs of the command, real brokers and processes."""


def pytest_collection_modifyitems(items):
    """Whole runs first, unit tests after them, each group in its own order. Under pytest-xdist
    (`make test`: `-n 2 --dist loadfile`) the long files then start early and the many short unit
    files fill the workers' gaps, instead of one long file running alone at the end."""
    items.sort(key=lambda item: not item.nodeid.startswith(WHOLE_RUNS))
