"""Test-suite wide fixtures: the real brokers (started by harness/brokers.py) and a federation
over the loopback broker (tests/loopback_runs.py); and the order the suite runs in."""

import pytest

from coordinator.brokers.embedded import EmbeddedBroker
from harness.brokers import Mosquitto
from loopback_runs import federation, quiet_torch  # noqa: F401  (fixtures)


@pytest.fixture
def mosquitto(tmp_path):
    broker = Mosquitto(tmp_path / "mosquitto").start()
    yield broker
    broker.stop()


@pytest.fixture
def amqtt_broker():
    with EmbeddedBroker() as broker:
        yield broker


@pytest.fixture(params=["mosquitto", "amqtt"])
def any_broker(request, tmp_path):
    """Each test using it runs once against Mosquitto and once against amqtt: (url, protocol)."""
    if request.param == "mosquitto":
        broker = Mosquitto(tmp_path / "mosquitto").start()
        yield broker.url, "auto"
        broker.stop()
    else:
        with EmbeddedBroker() as embedded:
            yield embedded.url, "3.1.1"


WHOLE_RUNS = ("tests/e2e/", "tests/integration/")
"""Where the long files are: whole runs of the command, real brokers and processes."""


def pytest_collection_modifyitems(items):
    """Whole runs first, unit tests after them, each group in its own order. Under pytest-xdist
    (`make test`: `-n 2 --dist loadfile`) the long files then start early and the many short unit
    files fill the workers' gaps, instead of one long file running alone at the end."""
    items.sort(key=lambda item: not item.nodeid.startswith(WHOLE_RUNS))
