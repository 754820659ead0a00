"""The weak-device client over a real Mosquitto, with the test playing the coordinator.

A cnn8 body exported to ONNX (torch and `export` are used here, to build the fixture) is the
released representation. The devices learn of it from the retained RELEASE manifest, fetch it
(a corrupted copy is rejected and fetched again), answer EVALUATE with their accuracy and class
means, and write a personalized ONNX model whose labels are their own predictions. One device
runs in a subprocess where torch, scikit-learn and scipy cannot be imported at all. Devices on a
tabular task and on a signal task personalize small onnx.helper bodies the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx_bodies import dense_body, spectrum_body

from edge_sdk.channel import Channel
from edge_sdk.data import BUILTIN_TASKS, load_client_data
from edge_sdk.lite import LiteClient, class_statistics
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Topics
from edge_sdk.transport import MqttSettings, MqttTransport

pytestmark = pytest.mark.integration

FEDERATION = "lite"
TOPICS = Topics(FEDERATION)
RUN = "run-lite"
CLIENTS = 3
REPO = Path(__file__).resolve().parents[2]

BLOCKED = ("torch", "torchvision", "sklearn", "scipy", "skl2onnx")
"""What `pip install "edgepfl[lite]"` does not bring."""

LITE_ONLY_RUNNER = """
import importlib.abc, json, logging, sys

BLOCKED = BLOCKED_MODULES

class Blocked(importlib.abc.MetaPathFinder):
    # not installed as far as this process can tell
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Blocked())
logging.basicConfig(level=logging.INFO)
import numpy as np
import edge_sdk.lite
imported_on_import = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
from edge_sdk.data import BUILTIN_TASKS, ClientData

url, state_dir, data_path, out = sys.argv[1:5]
with np.load(data_path) as arrays:  # the digits loader needs scikit-learn: the test process loads them
    data = ClientData(arrays["train_x"], arrays["train_y"], arrays["test_x"], arrays["test_y"], BUILTIN_TASKS["digits"])
client = edge_sdk.lite.LiteClient("dev2", data, head="lr", broker=url, federation="lite", state_dir=state_dir)
client.run()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
with open(out, "w") as handle:
    json.dump({"on_import": imported_on_import, "at_exit": loaded, "accuracy": client.evaluation.accuracy}, handle)
""".replace("BLOCKED_MODULES", repr(BLOCKED))


@pytest.fixture(scope="module")
def representation(tmp_path_factory) -> bytes:
    """An untrained cnn8 body exported as a representation (input `input`, output `features`)."""
    import torch

    from edge_sdk.models import build_body
    from export.onnx_export import export_module

    task = BUILTIN_TASKS["digits"]
    torch.manual_seed(0)
    body, feature_dim = build_body("cnn8", task)
    metadata = {"input_shape": list(task.input_shape),
                "normalization": {"mean": list(task.mean), "std": list(task.std)}, "feature_dim": feature_dim,
                "class_names": list(task.class_names), "algorithm": "repper", "run_id": RUN, "round": 3,
                "dataset": "digits", "model": "cnn8"}
    path = tmp_path_factory.mktemp("release") / "representation.onnx"
    export_module(body, task.input_shape, path, metadata=metadata)
    return path.read_bytes()


class StandIn:
    """The coordinator's side of the release protocol, played by hand over its own connection."""

    def __init__(self, url: str):
        self.transport = MqttTransport(f"{FEDERATION}.{COORDINATOR}", MqttSettings(url=url))
        self.transport.connect()
        self.transport.subscribe(TOPICS.all_up())
        self.channel = Channel(self.transport, TOPICS)
        self.backlog: list[Envelope] = []

    def send(self, kind: Kind, to: str | None = None, *, retain: bool = False, run_id: str = RUN,
             **fields) -> Envelope:
        envelope = Envelope(kind, COORDINATOR, run_id=run_id, **fields)
        topic = TOPICS.broadcast(kind) if to is None else TOPICS.down(to, kind)
        self.channel.send(topic, envelope, retain=retain)
        return envelope

    def release(self, body: bytes, *, run_id: str = RUN) -> Envelope:
        config = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body), "format": "onnx",
                  "metadata": {"feature_dim": 128}}
        return self.send(Kind.RELEASE, retain=True, run_id=run_id, round=3, config=config)

    def artifact(self, to: str, body: bytes, sha256: str) -> None:
        self.send(Kind.ARTIFACT, to, round=3, config={"sha256": sha256},
                  groups={"artifact": {"onnx": np.frombuffer(body, dtype=np.uint8)}})

    def expect(self, kind: Kind, sender: str, timeout: float = 30.0) -> Envelope:
        """The next message of `kind` from `sender`; others wait in the backlog."""
        for envelope in self.backlog:
            if (envelope.kind, envelope.sender) == (kind, sender):
                self.backlog.remove(envelope)
                return envelope
        while True:
            received = self.channel.receive(timeout=timeout)
            if received is None:
                raise AssertionError(f"no {kind.value} from {sender} within {timeout} s")
            if (received.envelope.kind, received.envelope.sender) == (kind, sender):
                return received.envelope
            self.backlog.append(received.envelope)

    def welcome(self, sender: str) -> Envelope:
        hello = self.expect(Kind.HELLO, sender)
        self.send(Kind.WELCOME, sender, config={"settings": {}, "hyper": {}})
        return hello

    def close(self) -> None:
        self.transport.close()


@pytest.fixture
def stand_in(mosquitto):
    coordinator = StandIn(mosquitto.url)
    yield coordinator
    coordinator.close()


def start(client: LiteClient, stop: threading.Event) -> threading.Thread:
    thread = threading.Thread(target=client.run, args=(stop,), daemon=True)
    thread.start()
    return thread


def lite_client(url: str, index: int, state_dir: Path, **options) -> LiteClient:
    data = load_client_data("digits", num_clients=CLIENTS, index=index, seed=0)
    return LiteClient(f"dev{index}", data, broker=url, federation=FEDERATION, state_dir=state_dir / f"dev{index}",
                      **options)


def test_a_device_fetches_verifies_personalizes_and_reports(mosquitto, stand_in, representation, tmp_path):
    # Prepare: the retained manifest is an older run's
    stop = threading.Event()
    sha = hashlib.sha256(representation).hexdigest()
    stand_in.release(b"an older run's representation", run_id="run-old")
    client = lite_client(mosquitto.url, 0, tmp_path, head="svm")
    thread = start(client, stop)
    corrupted = bytearray(representation)
    corrupted[len(corrupted) // 2] ^= 0xFF

    # Execute
    hello = stand_in.welcome("dev0")
    stand_in.release(representation)
    first_fetch = stand_in.expect(Kind.FETCH, "dev0")
    stand_in.send(Kind.EVALUATE, round=3, config={"selected": ["dev0"]})  # before the artifact
    stand_in.artifact("dev0", bytes(corrupted), sha)
    second_fetch = stand_in.expect(Kind.FETCH, "dev0")
    stand_in.artifact("dev0", representation, sha)
    reply = stand_in.expect(Kind.EVAL_RES, "dev0", timeout=60)
    stop.set()
    thread.join(timeout=30)

    # Assert: registration and fetching
    assert hello.config["device_type"] == "lite" and hello.config["head"] == "svm"
    assert hello.config["heads"] == ["svm", "lr", "mlp", "ncm"]
    assert hello.metrics == {"num_examples": client.data.num_train, "num_test": client.data.num_test}
    assert first_fetch.config == second_fetch.config == {"sha256": sha}
    assert first_fetch.run_id == RUN
    assert client.channel.rejections["chunk_checksum"] == 1
    assert (tmp_path / "dev0" / "artifacts" / f"{sha}.onnx").read_bytes() == representation
    # the reply
    assert reply.round == 3 and reply.metrics["accuracy"] >= 0.8
    assert reply.metrics["num_test"] == client.data.num_test and reply.metrics["num_train"] == client.data.num_train
    assert client.evaluation is not None
    assert reply.metrics["accuracy"] == pytest.approx(client.evaluation.accuracy)
    # prototypes: class counts and means, never per-example features
    assert list(reply.groups) == ["prototypes"]
    prototypes = reply.groups["prototypes"]
    assert set(prototypes) == {"counts", "means"}
    assert prototypes["counts"].shape == (10,) and prototypes["counts"].dtype == np.int64
    assert prototypes["means"].shape == (10, 128) and prototypes["means"].dtype == np.float32
    assert prototypes["counts"].sum() == client.data.num_train
    np.testing.assert_array_equal(prototypes["counts"], client.data.class_counts())
    # the personalized model gives the device's own predictions
    path = tmp_path / "dev0" / "personalized-dev0.onnx"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    labels, probabilities = session.run(["label", "probabilities"], {"input": client.data.test_x})
    np.testing.assert_array_equal(labels, client.evaluation.predictions)
    assert probabilities.shape == (client.data.num_test, 10)
    assert json.loads(session.get_modelmeta().custom_metadata_map["head"]) == "svm"


def test_a_late_device_learns_the_release_from_the_retained_manifest(mosquitto, stand_in, representation,
                                                                     tmp_path):
    # Prepare: the release was published (retained) long before; the final evaluation carries the
    # global prototypes
    stop = threading.Event()
    sha = hashlib.sha256(representation).hexdigest()
    stand_in.release(representation)
    counts, means = global_prototypes(representation)
    client = lite_client(mosquitto.url, 1, tmp_path, head="ncm", share_prototypes=False)
    thread = start(client, stop)

    # Execute
    stand_in.welcome("dev1")
    fetch = stand_in.expect(Kind.FETCH, "dev1")
    stand_in.artifact("dev1", representation, sha)
    stand_in.send(Kind.EVALUATE, round=4, config={"selected": ["dev1"]},
                  groups={"prototypes": {"counts": counts, "means": means}})
    reply = stand_in.expect(Kind.EVAL_RES, "dev1", timeout=60)
    stop.set()
    thread.join(timeout=30)

    # Assert
    assert fetch.config == {"sha256": sha}
    assert client.prototypes is not None
    np.testing.assert_array_equal(client.prototypes[0], counts)
    assert reply.round == 4 and reply.groups == {}
    assert reply.metrics["accuracy"] >= 0.8
    session = ort.InferenceSession(str(tmp_path / "dev1" / "personalized-dev1.onnx"),
                                   providers=["CPUExecutionProvider"])
    labels = session.run(["label"], {"input": client.data.test_x})[0]
    assert client.evaluation is not None
    np.testing.assert_array_equal(labels, client.evaluation.predictions)


def global_prototypes(representation: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Pooled class means over every device's training split, as the coordinator would pool them."""
    from edge_sdk.lite import FeatureExtractor

    extractor = FeatureExtractor(representation, providers="CPUExecutionProvider")
    statistics = [class_statistics(extractor.embed(data.train_x), data.train_y, 10)
                  for data in (load_client_data("digits", num_clients=CLIENTS, index=i, seed=0)
                               for i in range(CLIENTS))]
    counts = np.sum([c for c, _ in statistics], axis=0)
    sums = np.sum([c[:, None] * m.astype(np.float64) for c, m in statistics], axis=0)
    return counts.astype(np.int64), (sums / np.maximum(counts, 1)[:, None]).astype(np.float32)


def test_the_lite_client_runs_where_torch_sklearn_and_scipy_cannot_be_imported(mosquitto, stand_in, representation,
                                                                                tmp_path):
    # Prepare
    sha = hashlib.sha256(representation).hexdigest()
    stand_in.release(representation)
    out = tmp_path / "result.json"
    data = load_client_data("digits", num_clients=3, index=2, seed=0)
    np.savez(tmp_path / "dev2.npz", train_x=data.train_x, train_y=data.train_y, test_x=data.test_x,
             test_y=data.test_y)
    runner = tmp_path / "runner.py"
    runner.write_text(LITE_ONLY_RUNNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, str(runner), mosquitto.url, str(tmp_path / "dev2"),
                                str(tmp_path / "dev2.npz"), str(out)],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # Execute
    try:
        stand_in.welcome("dev2")
        stand_in.expect(Kind.FETCH, "dev2")
        stand_in.artifact("dev2", representation, sha)
        stand_in.send(Kind.EVALUATE, round=3, config={"selected": ["dev2"]})
        reply = stand_in.expect(Kind.EVAL_RES, "dev2", timeout=60)
        stand_in.send(Kind.STATUS, retain=True, round=3, config={"state": "finished"})
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()

    # Assert
    assert process.returncode == 0, output
    result = json.loads(out.read_text())
    assert result["on_import"] == [] and result["at_exit"] == []
    assert reply.metrics["accuracy"] == pytest.approx(result["accuracy"]) and result["accuracy"] >= 0.8
    assert (tmp_path / "dev2" / "personalized-dev2.onnx").exists()


@pytest.mark.parametrize("dataset, body, minimum", [
    ("breast_cancer", lambda task: dense_body(task, hidden=64, seed=1), 0.85),
    ("synthetic_vibration", spectrum_body, 0.75),
])
def test_a_device_personalizes_on_feature_vectors_and_signals(mosquitto, stand_in, tmp_path, dataset, body, minimum):
    # Prepare: a representation of the task's samples ([N, 30] rows, [N, 3, 128] windows)
    stop = threading.Event()
    data = load_client_data(dataset, num_clients=CLIENTS, index=0, seed=0)
    representation = body(data.task)
    sha = hashlib.sha256(representation).hexdigest()
    client = LiteClient("dev0", data, head="lr", broker=mosquitto.url, federation=FEDERATION,
                        state_dir=tmp_path / "dev0")
    thread = start(client, stop)

    # Execute
    hello = stand_in.welcome("dev0")
    stand_in.release(representation)
    stand_in.expect(Kind.FETCH, "dev0")
    stand_in.artifact("dev0", representation, sha)
    stand_in.send(Kind.EVALUATE, round=3, config={"selected": ["dev0"]})
    reply = stand_in.expect(Kind.EVAL_RES, "dev0", timeout=60)
    stop.set()
    thread.join(timeout=30)

    # Assert
    assert hello.config["task"] == dataset
    assert reply.metrics["accuracy"] >= minimum
    counts = reply.groups["prototypes"]["counts"]
    np.testing.assert_array_equal(counts, client.data.class_counts())
    session = ort.InferenceSession(str(tmp_path / "dev0" / "personalized-dev0.onnx"),
                                   providers=["CPUExecutionProvider"])
    labels = session.run(["label"], {"input": data.test_x})[0]
    assert client.evaluation is not None
    np.testing.assert_array_equal(labels, client.evaluation.predictions)
