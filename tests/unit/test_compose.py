"""Composing a released body with a personal head into one ONNX model.

For every head kind the composed model's `label` must be what the Python pipeline (torch body,
then the head's `predict`) says, and `probabilities` must have one column per class of the
dataset that sums to 1 (the softmax of the head's scores), zeros for classes the head never saw.
Bodies of 1-D signals [C, L] and of feature vectors [D], fp32 or int8, compose like images.
`edge_sdk.lite.compose` and the heads must work where torch, scikit-learn and scipy cannot be
imported at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from threadpoolctl import threadpool_limits

from edge_sdk.data import load_dataset
from edge_sdk.lite.compose import ComposeError, compose, dense_head_to_onnx, ncm_head_to_onnx
from edge_sdk.lite.heads import HEADS, DenseHead, class_statistics, fit_head
from edge_sdk.models import build_body
from edge_sdk.training import recalibrate_batchnorm
from export import compose_torch_head, export_body, export_module

CLASSES = 10
TRAIN = slice(0, 1200)
TEST = slice(1200, None)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    """BLAS/OpenMP threads only fight over the shared cores here (a 0.04 s logistic regression
    fit takes seconds with them), so this module runs with one."""
    with threadpool_limits(1):
        yield


class Setup:
    """A cnn8 body exported to ONNX, digits images and the torch body's features of them."""

    def __init__(self, directory: Path):
        pool = load_dataset("digits")
        self.x, self.y = np.array(pool.x), np.array(pool.y)
        torch.manual_seed(0)
        body, self.dim = build_body("cnn8", pool.task)
        recalibrate_batchnorm(body, torch.from_numpy(self.x[:512]))
        self.body = body.eval()
        with torch.no_grad():
            self.features = self.body(torch.from_numpy(self.x)).numpy()
        self.body_path = export_module(self.body, (1, 8, 8), directory / "body.onnx",
                                       metadata={"model": "cnn8", "dataset": "digits"}).path

    def train(self, classes: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        features, labels = self.features[TRAIN], self.y[TRAIN]
        keep = np.ones(len(labels), bool) if classes is None else np.isin(labels, classes)
        return features[keep], labels[keep]

    def run(self, path: Path) -> tuple[np.ndarray, np.ndarray]:
        runner = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        label, probabilities = runner.run(["label", "probabilities"], {"input": self.x[TEST]})
        return label, probabilities


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(tmp_path_factory.mktemp("compose"))


def assert_probabilities(probabilities: np.ndarray, absent: Sequence[int] = ()) -> None:
    assert probabilities.dtype == np.float32 and probabilities.shape[1] == CLASSES
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    assert (probabilities >= 0).all()
    assert not probabilities[:, list(absent)].any()


@pytest.mark.parametrize("kind", ["svm", "lr", "mlp"])
def test_a_dense_head_composes_and_gives_its_python_probabilities(setup: Setup, tmp_path: Path, kind: str) -> None:
    # Prepare
    head = fit_head(kind, *setup.train(), num_classes=CLASSES, seed=0)
    assert isinstance(head, DenseHead)

    # Execute
    path = compose(setup.body_path, head.to_onnx(setup.dim), tmp_path / "model.onnx", num_classes=CLASSES,
                   metadata={"head": kind})

    # Assert
    label, probabilities = setup.run(path)
    assert label.dtype == np.int64
    np.testing.assert_array_equal(label, head.predict(setup.features[TEST]))
    assert_probabilities(probabilities)
    np.testing.assert_allclose(probabilities, head.probabilities(setup.features[TEST]), atol=1e-4)
    metadata = {p.key: json.loads(p.value) for p in onnx.load(str(path)).metadata_props}
    body_metadata = {p.key: json.loads(p.value) for p in onnx.load(str(setup.body_path)).metadata_props}
    assert metadata == {**body_metadata, "head": kind, "format": "edgepfl-personalized/1", "num_classes": CLASSES}


def test_an_ncm_head_picks_the_nearest_present_class_mean(setup: Setup, tmp_path: Path) -> None:
    # Prepare
    features, labels = setup.train()
    _, means = class_statistics(features, labels, CLASSES)
    present = np.ones(CLASSES, bool)
    present[[0, 9]] = False

    # Execute
    path = compose(setup.body_path, ncm_head_to_onnx(means, present), tmp_path / "ncm.onnx",
                   num_classes=CLASSES, metadata={"head": "ncm"})

    # Assert
    label, probabilities = setup.run(path)
    classes = np.flatnonzero(present)
    test = setup.features[TEST].astype(np.float64)
    distances = ((test[:, None, :] - means[classes][None].astype(np.float64)) ** 2).sum(axis=2)
    np.testing.assert_array_equal(label, classes[distances.argmin(axis=1)])
    assert_probabilities(probabilities, absent=[0, 9])
    scores = -distances
    softmax = np.exp(scores - scores.max(1, keepdims=True))
    np.testing.assert_allclose(probabilities[:, classes], softmax / softmax.sum(1, keepdims=True), atol=1e-4)


@pytest.mark.parametrize("kind", HEADS)
def test_the_lite_heads_compose_and_predict_like_their_python_side(setup: Setup, tmp_path: Path, kind: str) -> None:
    # Prepare
    head = fit_head(kind, *setup.train(), num_classes=CLASSES, seed=0)

    # Execute
    path = compose(setup.body_path, head.to_onnx(setup.dim), tmp_path / f"{kind}.onnx", num_classes=CLASSES,
                   metadata={"head": kind})

    # Assert
    label, probabilities = setup.run(path)
    np.testing.assert_array_equal(label, head.predict(setup.features[TEST]))
    assert_probabilities(probabilities)


@pytest.mark.parametrize(("kind", "classes"), [("lr", [1, 4, 7]), ("svm", [3, 5]), ("mlp", [2, 8])],
                         ids=["lr-three-classes", "svm-binary", "mlp-binary"])
def test_a_head_trained_on_a_subset_of_classes_maps_to_the_right_columns(
    setup: Setup, tmp_path: Path, kind: str, classes: list[int]
) -> None:
    # Prepare
    head = fit_head(kind, *setup.train(classes), num_classes=CLASSES, seed=0)
    assert isinstance(head, DenseHead)
    absent = [c for c in range(CLASSES) if c not in classes]

    # Execute
    path = compose(setup.body_path, head.to_onnx(setup.dim), tmp_path / "subset.onnx", num_classes=CLASSES,
                   metadata={"head": kind})

    # Assert
    label, probabilities = setup.run(path)
    np.testing.assert_array_equal(label, head.predict(setup.features[TEST]))
    assert set(np.unique(label)) <= set(classes)
    assert_probabilities(probabilities, absent=absent)
    np.testing.assert_allclose(probabilities, head.probabilities(setup.features[TEST]), atol=1e-4)


def test_a_single_class_split_composes_as_a_constant_class_mean_head(setup: Setup, tmp_path: Path) -> None:
    # Prepare
    head = fit_head("lr", *setup.train([6]), num_classes=CLASSES)

    # Execute
    path = compose(setup.body_path, head.to_onnx(setup.dim), tmp_path / "single.onnx", num_classes=CLASSES,
                   metadata={"head": head.kind})

    # Assert
    label, probabilities = setup.run(path)
    assert head.kind == "ncm" and (label == 6).all()
    expected = np.zeros((len(label), CLASSES), np.float32)
    expected[:, 6] = 1.0
    np.testing.assert_array_equal(probabilities, expected)


def test_a_torch_linear_head_composes(setup: Setup, tmp_path: Path) -> None:
    # Prepare
    torch.manual_seed(1)
    head = torch.nn.Linear(setup.dim, CLASSES)

    # Execute
    path = compose_torch_head(setup.body_path, head, tmp_path / "torch.onnx", num_classes=CLASSES,
                              metadata={"owner": "dev000"})

    # Assert
    label, probabilities = setup.run(path)
    with torch.no_grad():
        logits = head(torch.from_numpy(setup.features[TEST]))
    np.testing.assert_array_equal(label, logits.argmax(dim=1).numpy())
    np.testing.assert_allclose(probabilities, logits.softmax(dim=1).numpy(), atol=1e-5)
    metadata = {p.key: json.loads(p.value) for p in onnx.load(str(path)).metadata_props}
    assert metadata["head"] == "torch" and metadata["owner"] == "dev000" and metadata["model"] == "cnn8"


def test_a_head_with_the_wrong_number_of_classes_is_refused(setup: Setup, tmp_path: Path) -> None:
    # Prepare
    head = fit_head("lr", *setup.train(), num_classes=CLASSES)
    assert isinstance(head, DenseHead)

    # Execute / Assert
    with pytest.raises(ComposeError, match="class indices in 0..4"):
        dense_head_to_onnx(head.layers, head.classes, 5)
    with pytest.raises(ComposeError, match="the last layer scores 10 classes, 9 are named"):
        dense_head_to_onnx(head.layers, head.classes[:9], CLASSES)
    with pytest.raises(ComposeError, match=r"layer 1: weights \[10, out\] and bias \[out\] expected, got \[7, 3\]"):
        dense_head_to_onnx([*head.layers, (np.ones((7, 3)), np.zeros(3))], np.arange(3), CLASSES)
    with pytest.raises(ComposeError, match="gives 10 probabilities, the dataset has 12 classes"):
        compose(setup.body_path, head.to_onnx(setup.dim), tmp_path / "bad.onnx", num_classes=12, metadata={})
    with pytest.raises(ComposeError, match=r"maps \[N, 128\] to \[7\]"):
        compose_torch_head(setup.body_path, torch.nn.Linear(setup.dim, 7), tmp_path / "bad.onnx",
                           num_classes=CLASSES, metadata={})
    assert not (tmp_path / "bad.onnx").exists()


def test_a_body_at_a_newer_opset_takes_an_opset_17_head(setup: Setup, tmp_path: Path) -> None:
    # Prepare
    body18 = export_module(setup.body, (1, 8, 8), tmp_path / "body18.onnx", metadata={}, opset=18).path
    _, means = class_statistics(*setup.train(), CLASSES)

    # Execute
    path = compose(body18, ncm_head_to_onnx(means, np.ones(CLASSES, bool)), tmp_path / "ncm18.onnx",
                   num_classes=CLASSES, metadata={"head": "ncm"})

    # Assert
    model = onnx.load(str(path))
    assert {o.domain or "ai.onnx": o.version for o in model.opset_import}["ai.onnx"] == 18
    label, probabilities = setup.run(path)
    assert float(np.mean(label == setup.y[TEST])) > 0.5
    assert_probabilities(probabilities)


def signal_and_tabular_bodies() -> dict[str, tuple[torch.nn.Module, np.ndarray, np.ndarray]]:
    """Small seeded bodies with seeded samples and labels: a conv1d body on 2-channel windows
    [2, 32] whose class is the dominant frequency, and an MLP on 12 features whose class is the
    sign pattern of the first two."""
    rng = np.random.default_rng(7)
    labels = np.arange(400) % 3
    t = np.linspace(0, 1, 32, dtype=np.float32)
    windows = np.sin(2 * np.pi * (2 + 3 * labels)[:, None, None] * t + rng.uniform(0, 3, (400, 2, 1)))
    windows = (windows + 0.2 * rng.standard_normal((400, 2, 32))).astype(np.float32)
    vectors = rng.standard_normal((400, 12)).astype(np.float32)
    torch.manual_seed(0)
    conv = torch.nn.Sequential(torch.nn.Conv1d(2, 8, 5, padding=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool1d(4),
                               torch.nn.Flatten())
    mlp = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU())
    return {"signal": (conv.eval(), windows, labels),
            "features": (mlp.eval(), vectors, (vectors[:, 0] > 0) + (vectors[:, 1] > 0).astype(np.int64))}


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("kind", ["signal", "features"])
def test_signal_and_tabular_bodies_compose_with_numpy_and_torch_heads(tmp_path: Path, kind: str,
                                                                      precision: str) -> None:
    # Prepare
    body, x, y = signal_and_tabular_bodies()[kind]
    summary = export_body(body, x.shape[1:], tmp_path / "body.onnx", metadata={"task": {"kind": kind}},
                          quantize="int8" if precision == "int8" else None, samples=x[:200])
    features = ort.InferenceSession(summary["path"], providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    dim, classes = summary["metadata"]["feature_dim"], 3
    head = fit_head("lr", features[:200], y[:200], num_classes=classes, seed=0)
    torch.manual_seed(1)
    torch_head = torch.nn.Linear(dim, classes)

    # Execute
    numpy_path = compose(summary["path"], head.to_onnx(dim), tmp_path / "lr.onnx", num_classes=classes,
                         metadata={"head": "lr"})
    torch_path = compose_torch_head(summary["path"], torch_head, tmp_path / "torch.onnx", num_classes=classes,
                                    metadata={})

    # Assert
    run = {path: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        ["label", "probabilities"], {"input": x[200:]}) for path in (numpy_path, torch_path)}
    np.testing.assert_array_equal(run[numpy_path][0], head.predict(features[200:]))
    with torch.no_grad():
        logits = torch_head(torch.from_numpy(features[200:]))
    np.testing.assert_array_equal(run[torch_path][0], logits.argmax(dim=1).numpy())
    for _, probabilities in run.values():
        assert probabilities.shape == (len(x) - 200, classes)
        np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    metadata = {p.key: json.loads(p.value) for p in onnx.load(str(numpy_path)).metadata_props}
    assert metadata["task"] == {"kind": kind} and metadata["input_shape"] == list(x.shape[1:])


BLOCKED = ("torch", "torchvision", "sklearn", "scipy", "skl2onnx")
"""What a weak device does not have: the lite code must not need any of it."""

LITE_ONLY = f"""
import importlib.abc, sys

BLOCKED = {BLOCKED!r}

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed on this device")
        return None

sys.meta_path.insert(0, Blocked())
import numpy as np
import onnxruntime as ort
from edge_sdk.lite.compose import compose
from edge_sdk.lite.heads import HEADS, fit_head

body, out = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
features, labels = rng.standard_normal((60, 128)).astype(np.float32), np.arange(60) % 3
for kind in HEADS:
    head = fit_head(kind, features, labels, num_classes=10)
    path = compose(body, head.to_onnx(128), f"{{out}}/{{kind}}.onnx", num_classes=10, metadata={{"head": kind}})
    runner = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    label, probabilities = runner.run(None, {{"input": rng.standard_normal((5, 1, 8, 8)).astype(np.float32)}})
    assert label.shape == (5,) and probabilities.shape == (5, 10), kind
loaded = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)
assert not loaded, loaded
print("lite-only ok")
"""


def test_lite_heads_and_compose_work_without_torch_sklearn_or_scipy(setup: Setup, tmp_path: Path) -> None:
    # Prepare: an import hook makes them unimportable, as on a device that never installed them
    script = tmp_path / "lite_only.py"
    script.write_text(textwrap.dedent(LITE_ONLY))

    # Execute
    done = subprocess.run([sys.executable, str(script), str(setup.body_path), str(tmp_path)], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})

    # Assert
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lite-only ok" in done.stdout
