"""The broker setup's generated secrets: passwords a command line can take as they are."""

from __future__ import annotations

from coordinator.brokers import mosquitto as broker_config


def test_a_generated_password_never_starts_with_a_dash(monkeypatch):
    # Prepare: the random source draws a password that begins with "-"
    monkeypatch.setattr(broker_config.secrets, "token_urlsafe", lambda n: "-" + "x" * 31)

    # Execute
    password = broker_config.new_password()

    # Assert: `--password -xxx` would be read as a flag; the password keeps its length
    assert password == "A" + "x" * 31
