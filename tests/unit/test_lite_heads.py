"""Unit tests for the lite heads: every kind fits separable features, nearest class mean covers
classes a device has no data for through global prototypes, class statistics match hand-made
numbers, the numpy heads decide like scikit-learn's estimators of the same objective (exactly on
small problems, within 2 points of accuracy on digits), and the ONNX heads agree with the Python
ones (full class columns even when a head saw fewer classes).

scikit-learn is only the reference here: the heads themselves import nothing but numpy and onnx.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler
from sklearn.svm import LinearSVC
from threadpoolctl import threadpool_limits

from edge_sdk.lite import HEADS, class_statistics, fit_head
from edge_sdk.lite.heads import DenseHead, NcmHead


def blobs(classes: int, dim: int, n: int, *, seed: int, spread: float = 1.0,
          labels: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gaussian blobs around fixed class centers (the same centers for every call with `seed`):
    (features float32 [n, dim], labels [n], centers [classes, dim])."""
    centers = np.random.default_rng(seed).normal(0.0, 4.0, (classes, dim))
    rng = np.random.default_rng(seed + 1000 + n)
    y = rng.integers(0, classes, n) if labels is None else rng.choice(labels, n)
    x = centers[y] + rng.normal(0.0, spread, (n, dim))
    return x.astype(np.float32), y.astype(np.int64), centers


def onnx_outputs(head, features: np.ndarray) -> dict[str, np.ndarray]:
    """Run a head's ONNX model; outputs by name."""
    session = ort.InferenceSession(head.to_onnx(features.shape[1]).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {session.get_inputs()[0].name: features}), strict=True))


@pytest.mark.parametrize("kind", HEADS)
def test_every_head_kind_separates_separable_features(kind: str) -> None:
    # Prepare
    x, y, _ = blobs(4, 16, 200, seed=0)
    x_test, y_test, _ = blobs(4, 16, 200, seed=0)

    # Execute
    head = fit_head(kind, x, y, num_classes=4, seed=0)

    # Assert
    assert head.kind == kind
    assert np.mean(head.predict(x_test) == y_test) >= 0.95


def test_ncm_predicts_a_class_the_device_never_saw_through_global_prototypes() -> None:
    # Prepare: the device has classes 0 and 1; the federation's prototypes also cover class 2
    x, y, centers = blobs(3, 8, 100, seed=1, labels=np.array([0, 1]))
    counts = np.array([50, 40, 30], dtype=np.int64)
    means = centers.astype(np.float32)
    near_two = (centers[2] + np.random.default_rng(2).normal(0.0, 0.5, (20, 8))).astype(np.float32)

    # Execute
    with_global = fit_head("ncm", x, y, num_classes=3, prototypes=(counts, means))
    local_only = fit_head("ncm", x, y, num_classes=3)

    # Assert
    assert (with_global.predict(near_two) == 2).all()
    assert not (local_only.predict(near_two) == 2).any()
    assert isinstance(with_global, NcmHead)
    np.testing.assert_array_equal(with_global.present, [True, True, True])


def test_ncm_uses_the_global_mean_for_covered_classes_and_its_own_for_the_others() -> None:
    # Prepare: local class 0 at 1, class 1 at 5; the global prototypes cover class 1 only (at 9)
    x = np.array([[1.0], [1.0], [5.0]], dtype=np.float32)
    y = np.array([0, 0, 1])
    prototypes = (np.array([0, 7, 0]), np.array([[0.0], [9.0], [0.0]], dtype=np.float32))

    # Execute
    head = fit_head("ncm", x, y, num_classes=3, prototypes=prototypes)

    # Assert
    assert isinstance(head, NcmHead)
    np.testing.assert_array_equal(head.means, [[1.0], [9.0], [0.0]])
    np.testing.assert_array_equal(head.present, [True, True, False])
    np.testing.assert_array_equal(head.predict(np.array([[4.9], [5.1], [-3.0]], dtype=np.float32)), [0, 1, 0])


def test_class_statistics_by_hand() -> None:
    # Prepare
    features = np.array([[1.0, 2.0], [3.0, 4.0], [10.0, 0.0]], dtype=np.float32)
    labels = np.array([0, 0, 2])

    # Execute
    counts, means = class_statistics(features, labels, 3)

    # Assert
    assert counts.dtype == np.int64 and means.dtype == np.float32
    np.testing.assert_array_equal(counts, [2, 0, 1])
    np.testing.assert_array_equal(means, [[2.0, 3.0], [0.0, 0.0], [10.0, 0.0]])


@pytest.mark.parametrize("kind", ["svm", "lr"])
def test_linear_heads_fit_two_thousand_by_512_features(kind: str) -> None:
    # Prepare: non-negative, overlapping features as a ReLU body gives them
    x, y, _ = blobs(10, 512, 2000, seed=3, spread=12.0)
    x_test, y_test, _ = blobs(10, 512, 500, seed=3, spread=12.0)
    x, x_test = np.maximum(x, 0), np.maximum(x_test, 0)

    # Execute
    head = fit_head(kind, x, y, num_classes=10, seed=0)

    # Assert
    assert np.mean(head.predict(x_test) == y_test) >= 0.9


@pytest.mark.parametrize("kind, reference, row_scale", [
    ("svm", LinearSVC(C=1.0, max_iter=100_000), 1 / np.sqrt(6)),  # standardized, then rows of norm ~1
    ("lr", LogisticRegression(C=1.0, tol=1e-8, max_iter=10_000), 1.0),
])
def test_a_linear_head_decides_like_scikit_learn_on_the_same_objective(kind: str, reference, row_scale: float) -> None:
    # Prepare: features on very different scales
    x, y, _ = blobs(3, 6, 150, seed=4, spread=3.0)
    scale = np.array([1e-2, 1.0, 1e2, 1.0, 10.0, 1e3], dtype=np.float32)
    x, x_test = x * scale, blobs(3, 6, 300, seed=4, spread=3.0)[0] * scale
    pipeline = make_pipeline(StandardScaler(), FunctionTransformer(lambda a: a * row_scale), reference)
    pipeline.fit(x.astype(np.float64), y)

    # Execute
    head = fit_head(kind, x, y, num_classes=3, seed=0)

    # Assert: the head takes raw features and decides as the pipeline does
    np.testing.assert_array_equal(head.predict(x_test), pipeline.predict(x_test.astype(np.float64)))


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Raw 8x8 digits pixels (0..16, some constant): 1,000 train, 797 test images."""
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x, y = data.data[order].astype(np.float32), data.target[order]
    return x[:1000], y[:1000], x[1000:], y[1000:]


SKLEARN_REFERENCES = {  # the same models and objectives, on the same standardized features
    "svm": lambda: make_pipeline(StandardScaler(), FunctionTransformer(lambda a: a / 8.0),  # rows / sqrt(64)
                                 LinearSVC(C=1.0, max_iter=100_000)),
    "lr": lambda: make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=5000)),
    "mlp": lambda: make_pipeline(StandardScaler(), MLPClassifier(hidden_layer_sizes=(128,), alpha=1e-3,
                                                                 max_iter=300, random_state=0)),
}


@pytest.mark.parametrize("kind", sorted(SKLEARN_REFERENCES))
def test_a_head_is_as_accurate_as_scikit_learn_and_its_onnx_model_predicts_the_same(digits, kind: str) -> None:
    # Prepare
    x, y, x_test, y_test = digits
    with threadpool_limits(1):
        reference = SKLEARN_REFERENCES[kind]().fit(x, y)

        # Execute
        head = fit_head(kind, x, y, num_classes=10, seed=0)
        outputs = onnx_outputs(head, x_test)

    # Assert
    assert isinstance(head, DenseHead)
    accuracy = np.mean(head.predict(x_test) == y_test)
    assert accuracy >= np.mean(reference.predict(x_test) == y_test) - 0.02
    assert accuracy >= 0.94
    np.testing.assert_array_equal(outputs["label"], head.predict(x_test))
    assert outputs["label"].dtype == np.int64
    np.testing.assert_allclose(outputs["probabilities"], head.probabilities(x_test), atol=1e-5)


def test_a_binary_svm_scores_one_side_and_its_probability_is_the_sigmoid_of_that_score() -> None:
    # Prepare: two of five classes
    x, y, _ = blobs(5, 8, 120, seed=7, labels=np.array([1, 4]), spread=3.0)
    x_test, _, _ = blobs(5, 8, 100, seed=7, labels=np.array([1, 4]), spread=3.0)

    # Execute
    head = fit_head("svm", x, y, num_classes=5)
    probabilities = onnx_outputs(head, x_test)["probabilities"]

    # Assert: scores (0, s) for classes (1, 4): P(4) = sigmoid(s), and 4 is predicted where s > 0
    assert isinstance(head, DenseHead)
    (weights, bias), = head.layers
    np.testing.assert_array_equal(head.classes, [1, 4])
    np.testing.assert_array_equal(weights[:, 0], 0.0)
    assert bias[0] == 0.0
    score = x_test.astype(np.float64) @ weights[:, 1] + bias[1]
    np.testing.assert_allclose(probabilities[:, 4], 1.0 / (1.0 + np.exp(-score)), atol=1e-5)
    np.testing.assert_array_equal(head.predict(x_test), np.where(score > 0, 4, 1))


def test_constant_features_get_zero_weights() -> None:
    # Prepare: features 2 and 5 are constant (dead ReLU units)
    x, y, _ = blobs(3, 6, 90, seed=8)
    x[:, [2, 5]] = np.array([0.0, 3.0], dtype=np.float32)

    # Execute
    heads = [fit_head(kind, x, y, num_classes=3) for kind in ("svm", "lr", "mlp")]

    # Assert
    for head in heads:
        assert isinstance(head, DenseHead)
        np.testing.assert_array_equal(head.layers[0][0][[2, 5]], 0.0)
        assert np.mean(head.predict(x) == y) >= 0.95


@pytest.mark.parametrize("kind", HEADS)
def test_a_head_on_a_subset_of_classes_predicts_only_those_and_its_onnx_agrees(kind: str) -> None:
    # Prepare: 6 classes in the federation, this device has 1, 3 and 5
    x, y, _ = blobs(6, 12, 150, seed=5, labels=np.array([1, 3, 5]))
    x_test, _, _ = blobs(6, 12, 200, seed=5)

    # Execute
    head = fit_head(kind, x, y, num_classes=6, seed=0)
    predicted = head.predict(x_test)
    outputs = onnx_outputs(head, x_test)

    # Assert
    assert set(predicted.tolist()) == {1, 3, 5}
    np.testing.assert_array_equal(outputs["label"], predicted)
    assert outputs["probabilities"].shape == (200, 6)
    np.testing.assert_array_equal(outputs["probabilities"][:, [0, 2, 4]], 0.0)


def test_a_single_class_split_gives_a_class_mean_head() -> None:
    # Prepare
    x, y, _ = blobs(4, 5, 30, seed=6, labels=np.array([2]))

    # Execute
    head = fit_head("svm", x, y, num_classes=4)

    # Assert
    assert head.kind == "ncm"
    assert (head.predict(blobs(4, 5, 50, seed=6)[0]) == 2).all()


@pytest.mark.parametrize("kind, labels, error", [
    ("knn", np.array([0, 1]), "unknown head"),
    ("svm", np.array([0, 3]), "labels must be in"),
])
def test_bad_arguments_are_refused(kind: str, labels: np.ndarray, error: str) -> None:
    # Prepare
    features = np.zeros((2, 4), dtype=np.float32)

    # Execute / Assert
    with pytest.raises(ValueError, match=error):
        fit_head(kind, features, labels, num_classes=3)
