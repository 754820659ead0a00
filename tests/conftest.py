"""Test-suite wide fixtures: the real brokers (tests/brokers.py) and a federation over the
loopback broker (tests/loopback_runs.py)."""

from brokers import amqtt_broker, any_broker, mosquitto  # noqa: F401  (fixtures)
from loopback_runs import federation  # noqa: F401  (fixture)
