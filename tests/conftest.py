"""Test-suite wide fixtures: the real brokers (tests/brokers.py)."""

from brokers import amqtt_broker, any_broker, mosquitto  # noqa: F401  (fixtures)
