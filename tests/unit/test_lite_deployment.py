"""A weak device keeps its last good release: it deploys its first release, replaces it with one
that scores at least as well on its own data, keeps it (and says why) against one that scores
lower, follows an operator's rollback even when it scores lower, keeps it against a release that
fails verification, and remembers what it deploys across a restart.

The releases are small onnx.helper bodies on digits (tests/onnx_bodies.py): random features of
128 dimensions score well with a logistic-regression head, 2 dimensions cannot, so "scores
lower" is real. The test hands the device its envelopes (`DeviceSession.handle`) and reads its
replies as the coordinator would, over the loopback broker.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from onnx_bodies import dense_body

from edge_sdk.channel import Channel
from edge_sdk.data import BUILTIN_TASKS, load_client_data
from edge_sdk.lite import LiteClient
from edge_sdk.lite.client import Release, release_log, show_releases
from edge_sdk.loopback import LoopbackBroker
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, ProtocolError, Topics

FEDERATION = "deploy"
TOPICS = Topics(FEDERATION)
RUN = "run-deploy"
TASK = BUILTIN_TASKS["digits"]
GOOD = dense_body(TASK, hidden=128, seed=0)
POOR = dense_body(TASK, hidden=2, seed=0)
NOT_ONNX = b"these bytes are no ONNX model" * 8
OTHER_TASK = dense_body(BUILTIN_TASKS["wine"], hidden=16)  # loads, but cannot embed 8x8 images


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class StandIn:
    """The coordinator's side: hands the device its envelopes and reads its replies."""

    def __init__(self, broker: LoopbackBroker):
        self.broker = broker
        transport = broker.transport(COORDINATOR)
        transport.connect()
        transport.subscribe(TOPICS.all_up())
        self.channel = Channel(transport, TOPICS)

    def device(self, state_dir: Path, **options) -> LiteClient:
        """dev0 on its digits split, joined to the run."""
        data = load_client_data("digits", num_clients=3, index=0, seed=0)
        client = LiteClient("dev0", data, head="lr", federation=FEDERATION, state_dir=state_dir,
                            providers="CPUExecutionProvider", transport=self.broker.transport("dev0"), **options)
        client.channel.transport.connect()
        client.handle(Envelope(Kind.WELCOME, COORDINATOR, run_id=RUN, config={"settings": {}, "hyper": {}}))
        return client

    def expect(self, kind: Kind) -> Envelope:
        """The next message of `kind` the device sent (its replies are routed as it sends them)."""
        while (received := self.channel.receive(timeout=1.0)) is not None:
            if received.envelope.kind is kind:
                return received.envelope
        raise AssertionError(f"no {kind.value} from the device")

    def release(self, device: LiteClient, body: bytes, **fields) -> None:
        config = {"sha256": sha(body), "size": len(body), "format": "onnx", "metadata": {"feature_dim": 128}}
        device.handle(Envelope(Kind.RELEASE, COORDINATOR, run_id=RUN, round=3, config=config | fields))

    def artifact(self, device: LiteClient, body: bytes, *, sent: bytes | None = None) -> None:
        """Answer the device's FETCH of `body` with `sent` (default: `body` itself)."""
        self.expect(Kind.FETCH)
        data = np.frombuffer(body if sent is None else sent, dtype=np.uint8)
        device.handle(Envelope(Kind.ARTIFACT, COORDINATOR, run_id=RUN, round=3, config={"sha256": sha(body)},
                               groups={"artifact": {"onnx": data}}))

    def evaluate(self, device: LiteClient) -> None:
        device.handle(Envelope(Kind.EVALUATE, COORDINATOR, run_id=RUN, round=3, config={"selected": ["dev0"]}))

    def offer(self, device: LiteClient, body: bytes, **fields) -> Envelope:
        """Release `body`, send it when asked, ask for an evaluation: the EVAL_RES."""
        self.release(device, body, **fields)
        self.artifact(device, body)
        self.evaluate(device)
        return self.expect(Kind.EVAL_RES)


@pytest.fixture
def stand_in() -> StandIn:
    return StandIn(LoopbackBroker())


def record(state_dir: Path) -> dict:
    return json.loads((state_dir / "deployed-dev0.json").read_text())


def test_the_first_release_is_deployed_and_recorded(stand_in, tmp_path, caplog):
    # Prepare
    device = stand_in.device(tmp_path)

    # Execute
    with caplog.at_level("INFO", logger=release_log.name):
        reply = stand_in.offer(device, GOOD, version=1)

    # Assert
    assert reply.config["release"] == reply.config["runs"] == sha(GOOD) and "kept" not in reply.config
    assert reply.metrics["accuracy"] == reply.metrics["deployed_accuracy"] >= 0.8
    assert device.evaluation is not None and device.evaluation.deployed
    assert device.model_path.is_file() and device.missing_model is None
    assert record(tmp_path) == {"sha256": sha(GOOD), "version": 1, "accuracy": reply.metrics["accuracy"],
                                "head": "lr", "model_path": str(device.model_path)}
    accuracy = reply.metrics["accuracy"]
    assert f"deploys release 1 ({sha(GOOD)[:12]}) (accuracy {accuracy:.4f} on its own data) to {device.model_path}" \
        in caplog.text


def test_the_release_lines_show_at_the_default_log_level():
    # Prepare: the command line's default, WARNING
    saved = release_log.level
    release_log.setLevel(logging.NOTSET)
    try:
        assert not release_log.isEnabledFor(logging.INFO) or logging.getLogger().isEnabledFor(logging.INFO)

        # Execute
        show_releases()

        # Assert
        assert release_log.isEnabledFor(logging.INFO)
    finally:
        release_log.setLevel(saved)


def test_a_newer_release_that_scores_lower_is_not_deployed(stand_in, tmp_path, caplog):
    # Prepare
    device = stand_in.device(tmp_path)
    first = stand_in.offer(device, GOOD, version=1)
    deployed_bytes = device.model_path.read_bytes()

    # Execute
    with caplog.at_level("INFO", logger=release_log.name):
        reply = stand_in.offer(device, POOR, version=2)

    # Assert: the model file, the record and the reply all say release 1
    good, poor = first.metrics["accuracy"], reply.metrics["accuracy"]
    assert poor < good
    assert device.model_path.read_bytes() == deployed_bytes
    assert [p.name for p in tmp_path.iterdir() if "candidate" in p.name] == []
    assert reply.config["release"] == sha(POOR) and reply.config["runs"] == sha(GOOD)
    assert reply.config["kept"] == f"scored {poor:.3f} < {good:.3f} on its own data"
    assert reply.metrics["deployed_accuracy"] == good
    assert record(tmp_path)["sha256"] == sha(GOOD) and record(tmp_path)["version"] == 1
    assert device.evaluation is not None and not device.evaluation.deployed
    kept_line = f"keeps release 1 ({sha(GOOD)[:12]}) (accuracy {good:.4f} on its own data) at {device.model_path}"
    assert kept_line in caplog.text
    assert f"release 2 ({sha(POOR)[:12]}) scored {poor:.4f}" in caplog.text


def test_a_newer_release_that_scores_higher_replaces_the_deployed_one(stand_in, tmp_path):
    # Prepare
    device = stand_in.device(tmp_path)
    first = stand_in.offer(device, POOR, version=1)
    deployed_bytes = device.model_path.read_bytes()

    # Execute
    reply = stand_in.offer(device, GOOD, version=2)

    # Assert
    assert reply.metrics["accuracy"] > first.metrics["accuracy"]
    assert reply.config["release"] == reply.config["runs"] == sha(GOOD) and "kept" not in reply.config
    assert reply.metrics["deployed_accuracy"] == reply.metrics["accuracy"]
    assert device.model_path.read_bytes() != deployed_bytes
    assert record(tmp_path)["sha256"] == sha(GOOD) and record(tmp_path)["version"] == 2


def test_a_rollback_is_followed_even_when_it_scores_lower(stand_in, tmp_path):
    # Prepare: release 2 (good) runs; the operator moves the fleet back to release 1 (poor)
    device = stand_in.device(tmp_path)
    first = stand_in.offer(device, GOOD, version=2)
    deployed_bytes = device.model_path.read_bytes()

    # Execute
    reply = stand_in.offer(device, POOR, version=1, rollback=True)

    # Assert
    assert reply.metrics["accuracy"] < first.metrics["accuracy"]
    assert reply.config["runs"] == sha(POOR) and "kept" not in reply.config
    assert reply.metrics["deployed_accuracy"] == reply.metrics["accuracy"]
    assert device.model_path.read_bytes() != deployed_bytes
    assert record(tmp_path)["sha256"] == sha(POOR) and record(tmp_path)["version"] == 1


@pytest.mark.parametrize("bad, reason, loads", [
    (NOT_ONNX, "verification failed: onnxruntime cannot load the representation", False),
    (OTHER_TASK, r"verification failed: its feature extractor failed: samples of shape \[N, \*\[13\]\]", True),
])
def test_a_release_that_fails_verification_keeps_the_deployed_one(stand_in, tmp_path, caplog, bad, reason, loads):
    # Prepare: release 1 runs; release 2's bytes match its manifest, but are no usable representation
    device = stand_in.device(tmp_path)
    first = stand_in.offer(device, GOOD, version=1)
    deployed_bytes = device.model_path.read_bytes()

    # Execute: the EVALUATE arrives before the artifact, and is answered once it failed
    with caplog.at_level("WARNING", logger="edge_sdk.lite.client"):
        stand_in.release(device, bad, version=2)
        stand_in.evaluate(device)
        stand_in.artifact(device, bad)
        reply = stand_in.expect(Kind.EVAL_RES)
        stand_in.evaluate(device)  # a later EVALUATE of the failed release is answered the same way
        again = stand_in.expect(Kind.EVAL_RES)

    # Assert
    for answer in (reply, again):
        assert answer.config["release"] == sha(bad) and answer.config["runs"] == sha(GOOD)
        assert answer.metrics["accuracy"] == 0.0
        assert answer.metrics["deployed_accuracy"] == first.metrics["accuracy"]
    assert re.match(reason, reply.config["kept"]) and again.config["kept"] == reply.config["kept"]
    assert device.model_path.read_bytes() == deployed_bytes and record(tmp_path)["sha256"] == sha(GOOD)
    assert (tmp_path / "artifacts" / f"{sha(bad)}.onnx").exists() == loads  # bytes onnxruntime refuses stay out
    assert f"release 2 ({sha(bad)[:12]}) failed verification" in caplog.text
    assert f"keeps release 1 ({sha(GOOD)[:12]})" in caplog.text


def test_an_artifact_never_received_intact_keeps_the_deployed_release(stand_in, tmp_path):
    # Prepare: one FETCH per release allowed; release 2 arrives damaged
    device = stand_in.device(tmp_path, max_fetches=1)
    first = stand_in.offer(device, GOOD, version=1)
    damaged = bytearray(GOOD)
    damaged[len(damaged) // 2] ^= 0xFF

    # Execute
    stand_in.release(device, GOOD + b"\0", version=2)
    stand_in.evaluate(device)
    stand_in.artifact(device, GOOD + b"\0", sent=bytes(damaged) + b"\0")
    reply = stand_in.expect(Kind.EVAL_RES)

    # Assert
    assert device.channel.rejections["chunk_checksum"] == 1
    assert reply.config["kept"] == "verification failed: artifact not received intact after 1 requests"
    assert reply.config["runs"] == sha(GOOD) and reply.metrics["deployed_accuracy"] == first.metrics["accuracy"]


def test_what_a_device_deploys_survives_a_restart(stand_in, tmp_path):
    # Prepare
    device = stand_in.device(tmp_path)
    first = stand_in.offer(device, GOOD, version=1)

    # Execute: the same device starts again on its state folder, and is offered a poorer release
    restarted = stand_in.device(tmp_path)
    _, hello = restarted.hello()
    reply = stand_in.offer(restarted, POOR, version=2)

    # Assert
    assert restarted.deployed == device.deployed
    assert hello["runs"] == sha(GOOD)
    assert reply.config["runs"] == sha(GOOD) and reply.metrics["deployed_accuracy"] == first.metrics["accuracy"]
    assert "kept" in reply.config


def test_a_damaged_deployment_record_is_read_as_none(stand_in, tmp_path, caplog):
    # Prepare
    (tmp_path / "deployed-dev0.json").write_text('{"sha256": "12')

    # Execute
    with caplog.at_level("WARNING", logger="edge_sdk.lite.deployment"):
        device = stand_in.device(tmp_path)
        reply = stand_in.offer(device, POOR, version=1)

    # Assert: nothing deployed, so even a poor release is deployed
    assert "deployed-dev0.json is damaged" in caplog.text and "starting as if nothing were deployed" in caplog.text
    assert reply.config["runs"] == sha(POOR) and record(tmp_path)["sha256"] == sha(POOR)


@pytest.mark.parametrize("fields, named", [
    ({"version": 0}, "version"), ({"version": True}, "version"), ({"version": "2"}, "version"),
    ({"rollback": "yes"}, "rollback"), ({"rollback": 1}, "rollback"),
])
def test_a_malformed_version_or_rollback_is_rejected(fields, named):
    # Prepare
    config = {"sha256": sha(GOOD), "size": len(GOOD), "format": "onnx", "metadata": {}}

    # Execute / Assert
    with pytest.raises(ProtocolError, match=f"malformed: release {named} "):
        Release.from_envelope(Envelope(Kind.RELEASE, COORDINATOR, run_id=RUN, config=config | fields))
    plain = Release.from_envelope(Envelope(Kind.RELEASE, COORDINATOR, run_id=RUN, config=config))
    numbered = Release.from_envelope(Envelope(Kind.RELEASE, COORDINATOR, run_id=RUN,
                                              config=config | {"version": 3, "rollback": True}))
    assert (plain.version, plain.rollback) == (None, False)
    assert (numbered.version, numbered.rollback) == (3, True)
