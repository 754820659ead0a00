"""Test-suite wide fixtures: the real brokers (started by harness/brokers.py) and a federation
over the loopback broker (tests/loopback_runs.py); and the order the suite runs in.

Every test process, and every process it starts, runs torch's CPU kernels on one thread: the suite
runs as many processes as the machine has cores (pytest-xdist workers, fleets of devices), and a
second OpenMP thread per process only spins while it waits for a core. On a busy 2-core machine that
made a tiny convolution take 20 to 80 ms instead of 0.1 ms, and the compatibility table's test
27 s (26 s of CPU) instead of 13 s (9 s). Set OMP_NUM_THREADS yourself to test another count."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before anything below imports torch

import pytest  # noqa: E402

from coordinator.brokers.embedded import EmbeddedBroker  # noqa: E402
from harness.brokers import Mosquitto  # noqa: E402
from loopback_runs import federation, quiet_torch  # noqa: E402, F401  (fixtures)


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
