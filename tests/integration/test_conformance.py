"""The conformance kit over a real Mosquitto: the Python devices pass it, broken ones fail it.

`edgepfl conformance` against `edgepfl client` (both real processes, seals checked with the
device's key from a credentials file) and the kit against `edgepfl lite-client` must pass every
section that applies. Each broken device is the real trainer with one behaviour changed through
a public method of its session (`send`, `current`, `answered`) or a wrong signing key, and the
kit must fail it on the section of the protocol that behaviour breaks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager

import pytest
from harness.brokers import Mosquitto

from coordinator.conformance.kit import run_kit
from coordinator.conformance.outcome import Report, Verdict
from coordinator.conformance.sections import KitSettings
from edge_sdk.client import EdgeClient
from edge_sdk.data import load_client_data
from edge_sdk.protocol import Kind
from edge_sdk.signing import new_key
from edge_sdk.transport import MqttSettings

pytestmark = pytest.mark.integration

DEVICE = "dev0"
TIMEOUTS = {"hello_timeout": 30.0, "reply_timeout": 30.0, "quiet_seconds": 0.3}
DEVICE_FLAGS = ["--client-id", DEVICE, "--index", "0", "--dataset", "digits", "--clients", "4"]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    started = Mosquitto(tmp_path_factory.mktemp("mosquitto")).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def data():
    return load_client_data("digits", num_clients=4, index=0, seed=0)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _edgepfl(*args: str) -> list[str]:
    return [sys.executable, "-m", "coordinator.cli", *args]


@contextmanager
def running(device: EdgeClient):
    """`device` runs in a thread for the block, and is stopped after it."""
    stop = threading.Event()
    thread = threading.Thread(target=device.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(timeout=15)


def _kit(broker: Mosquitto, federation: str, **settings) -> Report:
    return run_kit(MqttSettings(url=broker.url), federation, KitSettings(DEVICE, **{**TIMEOUTS, **settings}))


def _verdicts(report: Report) -> dict[str, Verdict]:
    return {key: outcome.verdict for key, outcome in report.outcomes.items()}


def test_the_python_trainer_passes_through_both_commands(broker, tmp_path):
    # Prepare: an anonymous broker, and a credentials file enrolling the device's signing key
    credentials = tmp_path / "credentials.json"
    credentials.write_text(json.dumps({
        "coordinator": {"username": "coordinator", "password": "x"},
        "devices": {DEVICE: {"username": DEVICE, "password": "x", "signing_key": new_key()}}}))
    common = ["--broker", broker.url, "--federation", "trainer", "--credentials", str(credentials)]
    client = subprocess.Popen(_edgepfl("client", *DEVICE_FLAGS, *common, "--state-dir", str(tmp_path / "state")),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # Execute
    try:
        kit = subprocess.run(_edgepfl("conformance", "--device-id", DEVICE, *common, "--hello-timeout", "60",
                                      "--reply-timeout", "30", "--quiet-seconds", "0.3"),
                             env=_env(), capture_output=True, text=True, timeout=120)
        client_output, _ = client.communicate(timeout=30)
    finally:
        client.kill()

    # Assert
    lines = {line.split()[1]: line.split()[0] for line in kit.stdout.splitlines()
             if line[:4] in ("PASS", "FAIL", "SKIP")}
    assert kit.returncode == 0, kit.stdout + kit.stderr
    assert lines == {"registration": "PASS", "envelope": "PASS", "chunking": "PASS", "training": "PASS",
                     "evaluation": "PASS", "release": "SKIP", "duplicates": "PASS", "rejection": "PASS",
                     "signing": "PASS", "nack": "PASS", "rejoin": "PASS", "codecs": "PASS"}, kit.stdout
    assert client.returncode == 0, client_output  # the kit's STATUS finished ended the device's run
    assert "refused" in client_output  # the NACK was logged as one line


def test_the_lite_client_passes(broker, tmp_path):
    # Prepare
    client = subprocess.Popen(_edgepfl("lite-client", *DEVICE_FLAGS, "--broker", broker.url, "--federation", "lite",
                                       "--state-dir", str(tmp_path / "state")),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # Execute
    try:
        report = _kit(broker, "lite", hello_timeout=60.0)
        client_output, _ = client.communicate(timeout=30)
    finally:
        client.kill()

    # Assert
    assert report.passed, "\n".join(report.lines())
    assert _verdicts(report) == {**{key: Verdict.PASS for key in report.outcomes},
                                 "training": Verdict.SKIP, "codecs": Verdict.SKIP, "signing": Verdict.SKIP}
    assert client.returncode == 0, client_output


# -- broken devices: the real trainer with one behaviour changed ------------------------------------
class RepliesWithoutInReplyTo(EdgeClient):
    """Replies that do not name their request."""

    def send(self, kind, round_=0, *, request=None, **fields):
        super().send(kind, round_, **fields)


class RepliesWithTheWrongRound(EdgeClient):
    """A TRAIN_RES numbered one round after its TRAIN."""

    def send(self, kind, round_=0, *, request=None, **fields):
        super().send(kind, round_ + 1 if kind is Kind.TRAIN_RES else round_, request=request, **fields)


class AnswersAnyRun(EdgeClient):
    """Trains on a TRAIN of a run it has not joined."""

    def current(self, envelope):
        return self.joined and self.client_id in envelope.config.get("selected", [])


class TrainsAgainOnARepeat(EdgeClient):
    """Never re-sends a cached reply: a repeated TRAIN is trained again, under a new msg_id."""

    def answered(self, request):
        return False


class UploadsPersonalState(EdgeClient):
    """Sends its personal parameters (FedAvg's BatchNorm statistics) with its update."""

    def send(self, kind, round_=0, *, request=None, **fields):
        if kind is Kind.TRAIN_RES and "groups" in fields:  # not a refusal
            assert self.algorithm is not None  # a device trains once it joined
            shared = {**fields["groups"]["shared"], **self.algorithm.personal_state()}
            fields["groups"] = {**fields["groups"], "shared": shared}
        super().send(kind, round_, request=request, **fields)


BROKEN = [
    (RepliesWithoutInReplyTo, None, "training", "in_reply_to is missing"),
    (RepliesWithTheWrongRound, None, "training", "round is 2, not the request's 1"),
    (AnswersAnyRun, None, "rejection", "answered a TRAIN of another run"),
    (TrainsAgainOnARepeat, None, "duplicates", "got a new reply"),
    (UploadsPersonalState, None, "training", "unexpected_arrays"),
    (EdgeClient, "another key", "signing", "not sealed with the device's key"),
]


@pytest.mark.parametrize("device_class, signing, section, reason", BROKEN,
                         ids=["no-in-reply-to", "wrong-round", "any-run", "trains-twice", "personal-upload",
                              "wrong-seal"])
def test_a_broken_device_fails_its_section(broker, data, tmp_path, device_class, signing, section, reason):
    # Prepare
    federation = f"broken-{device_class.__name__.lower()}"
    device_key, kit_key = (bytes.fromhex(new_key()), bytes.fromhex(new_key())) if signing else (None, None)
    device = device_class(DEVICE, data, broker=MqttSettings(url=broker.url, signing_key=device_key),
                          federation=federation, state_dir=tmp_path)

    # Execute
    with running(device):
        report = _kit(broker, federation, signing_key=kit_key)

    # Assert
    outcome = report.outcomes[section]
    assert outcome.verdict is Verdict.FAIL, "\n".join(report.lines())
    assert reason in outcome.reason
    assert not report.passed
