"""`edgepfl lite-client` started after its federation's run finished says that it waits, and
for what, without -v (real Mosquitto holding the finished run's retained STATUS)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading

import pytest

from edge_sdk.channel import Channel
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Topics
from edge_sdk.transport import MqttSettings, MqttTransport

pytestmark = pytest.mark.integration

FEDERATION = "waiting"


def _lines(stream) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_a_weak_device_after_the_run_says_once_without_verbose_that_it_waits(mosquitto, tmp_path):
    # Prepare: the finished run's STATUS stays on the broker, as a coordinator leaves it
    transport = MqttTransport(f"{FEDERATION}.coordinator", MqttSettings(url=mosquitto.url))
    transport.connect()
    topics = Topics(FEDERATION)
    Channel(transport, topics).send(topics.broadcast(Kind.STATUS), Envelope(
        Kind.STATUS, COORDINATOR, run_id="9f1c2b3a4d5e6f70", round=5,
        config={"state": "finished", "incarnation": "c1", "epoch": 1, "rounds": 5, "algorithm": "repper"}),
        retain=True)
    transport.close()
    command = [sys.executable, "-m", "coordinator.cli", "lite-client", "--client-id", "dev0", "--index", "0",
               "--clients", "3", "--dataset", "digits", "--broker", mosquitto.url, "--federation", FEDERATION,
               "--state-dir", str(tmp_path / "state")]

    # Execute
    device = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = _lines(device.stdout)
        seen: list[str] = []
        while not any("waiting for a coordinator" in line for line in seen):
            seen.append(lines.get(timeout=120))
    finally:
        device.terminate()
        device.wait(timeout=30)

    # Assert: one line, at INFO, naming the federation and the finished run; nothing before it
    assert len(seen) == 1, seen
    assert "INFO" in seen[0]
    assert ("dev0: waiting for a coordinator of federation waiting; last seen: run 9f1c2b3a4d5e6f70 finished "
            "after 5 rounds") in seen[0]
