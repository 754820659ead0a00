"""Weak devices on feature-vector and signal tasks: a representation embeds samples of any rank
its metadata states (in bounded batches), the heads personalize on tabular and signal features,
the composed model takes the raw samples, and examples/personalize_weak_device.py runs on a CSV.
The bodies are small ONNX graphs built with onnx.helper (tests/onnx_bodies.py)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx_bodies import dense_body, spectrum_body

from edge_sdk.data import BUILTIN_TASKS, load_client_data
from edge_sdk.lite import HEADS, FeatureExtractor, fit_head
from edge_sdk.lite.compose import compose

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "personalize_weak_device.py"


def test_embed_takes_samples_of_the_rank_the_metadata_states_in_any_batch_size():
    # Prepare
    task = BUILTIN_TASKS["wine"]
    extractor = FeatureExtractor(dense_body(task, hidden=16), providers="CPUExecutionProvider")
    x = np.random.default_rng(0).normal(0.0, 1.0, (50, 13))  # float64: converted batch by batch

    # Execute
    whole = extractor.embed(x)
    in_sevens = extractor.embed(x, batch_size=7)

    # Assert
    assert extractor.input_shape == (13,)
    assert whole.shape == (50, 16) and whole.dtype == np.float32
    np.testing.assert_allclose(in_sevens, whole, rtol=1e-6)
    with pytest.raises(ValueError, match=r"samples of shape \[N, \*\[13\]\] expected, got \[50, 12\]"):
        extractor.embed(x[:, :12])


@pytest.mark.parametrize("with_task", [True, False])
def test_the_task_comes_from_the_metadata(with_task: bool):
    # Prepare
    task = BUILTIN_TASKS["synthetic_vibration"]

    # Execute
    found = FeatureExtractor(dense_body(task, hidden=8, with_task=with_task), providers="CPUExecutionProvider").task(
        task.name)

    # Assert: the kind follows from the input shape's rank when the metadata has no `task` entry
    assert found == task


@pytest.fixture(scope="module")
def tabular() -> tuple[object, bytes, np.ndarray, np.ndarray]:
    """Device 0 of 3 on breast_cancer (iid), a random-features body and its embedded splits."""
    data = load_client_data("breast_cancer", num_clients=3, index=0, seed=0)
    body = dense_body(data.task, hidden=64, seed=1)
    extractor = FeatureExtractor(body, providers="CPUExecutionProvider")
    return data, body, extractor.embed(data.train_x), extractor.embed(data.test_x)


@pytest.mark.parametrize("kind", HEADS)
def test_every_head_personalizes_on_tabular_features_and_the_composed_model_takes_raw_rows(tabular, kind, tmp_path):
    # Prepare
    data, body, train, test = tabular

    # Execute
    head = fit_head(kind, train, data.train_y, num_classes=data.task.num_classes, seed=0)
    path = compose(body, head.to_onnx(train.shape[1]), tmp_path / "personal.onnx", num_classes=2,
                   metadata={"head": kind})
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    labels, probabilities = session.run(["label", "probabilities"], {"input": data.test_x})

    # Assert
    assert np.mean(head.predict(test) == data.test_y) >= 0.85
    np.testing.assert_array_equal(labels, head.predict(test))
    assert probabilities.shape == (data.num_test, 2)


def test_a_head_personalizes_on_signal_features():
    # Prepare: a device's windows of the synthetic vibration sensor, a spectrum body
    data = load_client_data("synthetic_vibration", num_clients=4, index=2, partition="dirichlet", seed=0, alpha=1.0)
    extractor = FeatureExtractor(spectrum_body(data.task), providers="CPUExecutionProvider")

    # Execute
    head = fit_head("lr", extractor.embed(data.train_x), data.train_y, num_classes=4, seed=0)

    # Assert
    assert np.mean(head.predict(extractor.embed(data.test_x)) == data.test_y) >= 0.75


def test_the_weak_device_example_personalizes_on_a_csv(tmp_path, monkeypatch, capsys):
    # Prepare: a body released for wine, a device's own rows as a CSV with class names as labels
    import sklearn.datasets

    task = BUILTIN_TASKS["wine"]
    (tmp_path / "body.onnx").write_bytes(dense_body(task, hidden=64, seed=2))
    bunch = sklearn.datasets.load_wine()
    header = ",".join([*bunch.feature_names, "label"])
    rows = [",".join([*map(str, row), task.class_names[label]])
            for row, label in zip(bunch.data, bunch.target, strict=True)]
    (tmp_path / "mine.csv").write_text("\n".join([header, *rows]) + "\n")
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--body", str(tmp_path / "body.onnx"), "--data",
                                      str(tmp_path / "mine.csv"), "--head", "lr", "--out", str(tmp_path / "p.onnx")])

    # Execute
    runpy.run_path(str(EXAMPLE), run_name="__main__")

    # Assert
    out = capsys.readouterr().out
    assert "lr head on 134 samples" in out and "on 44 held-out samples" in out
    accuracy = float(out.split("accuracy ")[1].split()[0])
    assert accuracy >= 0.85
    assert (tmp_path / "p.onnx").exists()
