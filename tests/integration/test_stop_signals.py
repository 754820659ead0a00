"""Stopping `edgepfl simulate` with a signal in each phase of a run, over a real Mosquitto.

Ctrl-C at a terminal sends SIGINT to the whole foreground process group; `kill PID` and `docker
stop` send SIGTERM to the command alone; `systemctl stop` and `kill -TERM -PGID` send it to every
process of the group. Whichever and whenever: the command ends with one line and its exit code
(130 for SIGINT, 143 for SIGTERM, as coordinator/cli.py documents), leaves no process behind,
and its run folder holds every round finished before the signal (at most the interrupted round
is lost): the checkpoint's round and the metrics' rounds agree, and no report claims an end.

Each signal is sent once its phase is seen on the broker, never after a sleep: a bystander
subscribed to the federation's downstream topics waits for the coordinator's retained STATUS
`registering` (one device of the run is never started, so registration lasts), a TRAIN of
round 2 (round 1 is committed), or the EVALUATE asking for BatchNorm statistics, which opens
the release phase.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable

import psutil
import pytest

from coordinator.run import checkpoint
from coordinator.run.folder import RunFolder
from ctrl_c import restore_ctrl_c
from edge_sdk.channel import Channel
from edge_sdk.protocol import STATISTICS, Envelope, Kind, Topics
from edge_sdk.transport import MqttSettings, MqttTransport

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
PHASE_TIMEOUT = 240.0
"""Seconds a phase may take to be seen (a loaded 2-core machine starts torch in three processes)."""
ROUNDS = 20

SIGNALS = {"sigint": (signal.SIGINT, 130, "interrupted"), "sigterm": (signal.SIGTERM, 143, "terminated")}
TARGETS = {"process": os.kill, "group": os.killpg}


def registering(envelope: Envelope) -> bool:
    return envelope.kind is Kind.STATUS and envelope.config.get("state") == "registering"


def round_two_started(envelope: Envelope) -> bool:
    return envelope.kind is Kind.TRAIN and envelope.round == 2


def release_phase_started(envelope: Envelope) -> bool:
    return envelope.kind is Kind.EVALUATE and envelope.config.get("phase") == STATISTICS


PHASES = {
    # three devices, two started: the coordinator waits for dev002 until its registration timeout
    "registration": (["--clients", "3", "--local-devices", "0-1", "--rounds", "2"], registering, (0, 0)),
    "mid-round": (["--clients", "2", "--rounds", str(ROUNDS)], round_two_started, (1, ROUNDS - 1)),
    "release": (["--clients", "2", "--rounds", "1", "--release"], release_phase_started, (1, 1)),
}


class Bystander:
    """An MQTT client reading the federation's downstream messages, as any device hears them."""

    def __init__(self, url: str, federation: str):
        self.transport = MqttTransport(f"{federation}.bystander", MqttSettings(url=url))
        self.transport.connect()
        topics = Topics(federation)
        self.channel = Channel(self.transport, topics)
        self.transport.subscribe(f"{topics.prefix}/down/#")

    def wait_for(self, command: subprocess.Popen, seen: Callable[[Envelope], bool], stderr: Path) -> None:
        deadline = time.monotonic() + PHASE_TIMEOUT
        while time.monotonic() < deadline:
            assert command.poll() is None, f"simulate ended before the phase: {stderr.read_text()}"
            received = self.channel.receive(1.0)
            if received is not None and seen(received.envelope):
                return
        pytest.fail(f"the phase was not seen within {PHASE_TIMEOUT:.0f} s: {stderr.read_text()}")

    def close(self) -> None:
        self.transport.close()


def committed_rounds(out: Path) -> int:
    """The rounds the run folder holds once the command stopped, checked for consistency: the
    checkpoint's round and the metrics' round records agree, and no report says the run ended."""
    folder = RunFolder(out)
    saved = checkpoint.load(folder.checkpoint)
    rounds = saved.round if saved is not None else 0
    lines = folder.metrics.read_text().splitlines() if folder.metrics.exists() else []
    recorded = [entry["round"] for entry in map(json.loads, lines) if entry.get("event") == "round"]
    assert recorded == list(range(1, rounds + 1)), f"checkpoint at round {rounds}, metrics has {recorded}"
    assert not folder.report.exists()
    return rounds


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", SIGNALS)
@pytest.mark.parametrize("phase", PHASES)
def test_a_signal_stops_simulate_with_its_code_and_one_line_leaving_nothing_and_a_consistent_run(
        tmp_path, mosquitto, phase, name, target):
    # Prepare: a bystander listening before the command starts, so no TRAIN escapes it
    flags, seen, (fewest, most) = PHASES[phase]
    sig, code, word = SIGNALS[name]
    federation, out, stderr = f"stop-{phase}-{name}-{target}", tmp_path / "run", tmp_path / "stderr"
    bystander = Bystander(mosquitto.url, federation)
    args = [sys.executable, "-m", "coordinator.cli", "simulate", *flags, "--workers", "2", "--local-epochs", "1",
            "--broker", mosquitto.url, "--federation", federation, "--registration-timeout", "600", "--quiet",
            "--out", str(out)]
    with open(stderr, "w") as errors:
        command = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=errors, cwd=ROOT, env=ENV,
                                   start_new_session=True, preexec_fn=restore_ctrl_c)
    children: list[psutil.Process] = []
    try:
        bystander.wait_for(command, seen, stderr)
        children = psutil.Process(command.pid).children(recursive=True)

        # Execute
        TARGETS[target](command.pid, sig)
        command.wait(timeout=120)

        # Assert: its code and one line first (a command killed outright fails here, at once)
        shown = stderr.read_text()
        assert command.returncode == code, shown
        assert [line for line in shown.splitlines() if line.strip()] == [
            f"edgepfl simulate: {word} (rerun the same command to resume)"], shown
        _, left_running = psutil.wait_procs(children, timeout=30)
    finally:
        bystander.close()
        if command.poll() is None:
            command.kill()
            command.wait()
        for child in children:  # whatever failed, nothing is left behind
            if child.is_running():
                child.kill()

    # Assert: its worker processes gone, the finished rounds kept
    assert len(children) >= 2 and left_running == []
    assert fewest <= committed_rounds(out) <= most
