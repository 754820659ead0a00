"""ONNX export of bodies, int8 quantization and loading a run's representation.

The exported file must compute what the PyTorch module computes (checked here independently
of the exporter's own parity check), on random and on real images, at any batch size; a bad
export must raise and leave nothing behind; int8 must be much smaller and stay close. The
representation of a real RepPer run loads with its BatchNorm statistics; a FedAvg run, which
keeps them on the devices, is refused with a message that says so.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from threadpoolctl import threadpool_limits
from torch import nn

from coordinator import checkpoint
from coordinator.config import RunConfig
from coordinator.simulate import run_simulation
from edge_sdk.config import ConfigError
from edge_sdk.data import load_client_data, load_dataset
from edge_sdk.models import build_body, statistics_keys
from edge_sdk.training import recalibrate_batchnorm
from export import (
    ExportMismatchError,
    RepresentationError,
    export_module,
    export_run,
    load_representation,
    quantize_int8,
)
from export.onnx_export import weights_sha256
from export.run import int8_path

SIZES = {"cnn8": 8, "cnn28": 28}


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    """BLAS/OpenMP threads only fight over the shared cores here (a 0.04 s logistic regression
    fit takes seconds with them), so this module runs with one."""
    with threadpool_limits(1):
        yield


def digits_at(size: int) -> np.ndarray:
    """The normalized digits images, resized (nearest neighbour) to size x size."""
    x = np.array(load_dataset("digits").x)
    index = np.arange(size) * 8 // size
    return np.ascontiguousarray(x[:, :, index][:, :, :, index])


def body_with_statistics(name: str, x: np.ndarray) -> nn.Module:
    """A seeded body whose BatchNorm statistics come from real images, in eval mode."""
    torch.manual_seed(0)
    body, _ = build_body(name, in_channels=1, image_size=x.shape[-1])
    recalibrate_batchnorm(body, torch.from_numpy(x[:512]))
    return body.eval()


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def torch_features(body: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return body(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("name", sorted(SIZES))
def test_fp32_export_equals_pytorch_on_random_and_real_inputs(tmp_path: Path, name: str) -> None:
    # Prepare
    x = digits_at(SIZES[name])
    body = body_with_statistics(name, x)
    real, check = x[1000:1300], x[:256]
    random = np.random.default_rng(5).standard_normal((64, *x.shape[1:])).astype(np.float32)

    # Execute
    result = export_module(body, x.shape[1:], tmp_path / f"{name}.onnx", metadata={"model": name},
                           check_inputs=check)

    # Assert
    data = result.path.read_bytes()
    assert result.sha256 == hashlib.sha256(data).hexdigest() and result.size_bytes == len(data)
    assert result.max_abs_diff <= 1e-4
    runner = session(result.path)
    for inputs in (real, random):
        (features,) = runner.run(None, {"input": inputs})
        assert np.max(np.abs(features - torch_features(body, inputs))) <= 1e-4
    assert body.training is False


def test_the_exported_model_has_a_dynamic_batch_axis_and_json_metadata(tmp_path: Path) -> None:
    # Prepare
    x = digits_at(8)
    body = body_with_statistics("cnn8", x)
    metadata = {"model": "cnn8", "class_names": [str(i) for i in range(10)], "normalization": {"mean": [0.3]}}

    # Execute
    result = export_module(body, (1, 8, 8), tmp_path / "body.onnx", metadata=metadata)

    # Assert
    model = onnx.load(str(result.path))
    assert [i.name for i in model.graph.input] == ["input"] and [o.name for o in model.graph.output] == ["features"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
    runner = session(result.path)
    for batch in (1, 7):
        (features,) = runner.run(None, {"input": x[:batch]})
        assert features.shape == (batch, 128)
        np.testing.assert_allclose(features, torch_features(body, x[:batch]), atol=1e-4)
    decoded = {prop.key: json.loads(prop.value) for prop in model.metadata_props}
    assert decoded == {**metadata, "format": "edgepfl-representation/1", "weights_sha256": weights_sha256(body)}
    assert decoded == result.metadata


class ExportsSomethingElse(nn.Module):
    """Computes the body in eager mode but body + 1 while being exported: a broken export."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.body(x)
        return features + 1.0 if torch.onnx.is_in_onnx_export() else features


def test_a_mismatching_export_raises_and_leaves_the_previous_file_alone(tmp_path: Path) -> None:
    # Prepare
    body = body_with_statistics("cnn8", digits_at(8))
    path = tmp_path / "body.onnx"
    good = export_module(body, (1, 8, 8), path, metadata={})
    before = path.read_bytes()

    # Execute
    with pytest.raises(ExportMismatchError, match=r"max \|onnx - torch\| = 1 exceeds"):
        export_module(ExportsSomethingElse(body), (1, 8, 8), path, metadata={})

    # Assert
    assert path.read_bytes() == before and good.sha256 == hashlib.sha256(before).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["body.onnx"]


def test_fp16_passes_its_documented_bound_but_not_a_zero_tolerance(tmp_path: Path) -> None:
    # Prepare
    x = digits_at(8)
    body = body_with_statistics("cnn8", x)
    fp32 = export_module(body, (1, 8, 8), tmp_path / "fp32.onnx", metadata={})

    # Execute
    fp16 = export_module(body, (1, 8, 8), tmp_path / "fp16.onnx", metadata={}, fp16=True, check_inputs=x[:256])
    with pytest.raises(ExportMismatchError, match="fp16"):
        export_module(body, (1, 8, 8), tmp_path / "strict.onnx", metadata={}, fp16=True, tolerance=0.0)

    # Assert
    assert not (tmp_path / "strict.onnx").exists()
    assert 0 < fp16.max_abs_diff <= 1e-2 * max(1.0, float(np.abs(torch_features(body, x[:256])).max()))
    assert fp16.size_bytes < 0.55 * fp32.size_bytes
    runner = session(fp16.path)
    assert runner.get_inputs()[0].type == "tensor(float)" and runner.get_outputs()[0].type == "tensor(float)"


def test_int8_is_a_quarter_of_fp32_for_cnn28_and_its_features_stay_close(tmp_path: Path) -> None:
    # Prepare
    x = digits_at(28)
    body = body_with_statistics("cnn28", x)
    fp32 = export_module(body, (1, 28, 28), tmp_path / "cnn28.onnx", metadata={"model": "cnn28"})

    # Execute
    int8 = quantize_int8(fp32.path, tmp_path / "cnn28.int8.onnx", x[:256])

    # Assert
    assert int8.size_bytes == int8.path.stat().st_size
    assert int8.ratio_to_fp32 == pytest.approx(int8.size_bytes / fp32.size_bytes)
    assert int8.ratio_to_fp32 <= 0.3  # measured 0.26; the target is <= 0.5
    held_out = x[1000:1400]
    reference = session(fp32.path).run(None, {"input": held_out})[0]
    quantized = session(int8.path).run(None, {"input": held_out})[0]
    correlation = np.corrcoef(reference.ravel(), quantized.ravel())[0, 1]
    assert correlation >= 0.999, f"int8 features correlate {correlation:.5f} with fp32"
    assert session(int8.path).run(None, {"input": held_out[:1]})[0].shape == (1, 512)
    metadata = {p.key: json.loads(p.value) for p in onnx.load(str(int8.path)).metadata_props}
    assert metadata == {**fp32.metadata, "quantization": "int8-qdq-per-channel"}


def test_int8_quantizes_the_weighted_operators_and_leaves_hard_swish_in_float(tmp_path: Path) -> None:
    # Prepare: a MobileNetV3-style block (conv, hard-swish, residual add)
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.conv = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = nn.functional.hardswish(self.stem(x))
            return (y + nn.functional.hardswish(self.conv(y))).mean(dim=(2, 3))

    x = digits_at(28)
    fp32 = export_module(Block().eval(), (1, 28, 28), tmp_path / "block.onnx", metadata={})

    # Execute
    int8 = quantize_int8(fp32.path, tmp_path / "block.int8.onnx", x[:64])

    # Assert: a value is quantized only where a Conv produces or reads it; the element-wise
    # operators' own outputs (hard-swish's Mul, the residual Add) stay float
    graph = onnx.load(str(int8.path)).graph
    producer = {out: node.op_type for node in graph.node for out in node.output}
    source = {node.output[0]: node.input[0] for node in graph.node if node.op_type in ("QuantizeLinear", "DequantizeLinear")}
    conv_reads = {source.get(source.get(name)) for node in graph.node if node.op_type == "Conv" for name in node.input}
    quantized = [node.input[0] for node in graph.node if node.op_type == "QuantizeLinear"]
    assert quantized
    for value in quantized:
        assert producer.get(value) in (None, "Conv") or value in conv_reads, f"{producer[value]} output {value} is quantized"
    assert any(producer.get(value) == "Mul" for value in quantized)  # the stem's hard-swish feeds the second conv
    assert not any(producer.get(value) in ("Add", "ReduceMean") for value in quantized)


def test_only_the_body_is_exportable_and_a_run_needs_a_checkpoint(tmp_path: Path) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="exportable parts: body"):
        load_representation(tmp_path, part="head")
    with pytest.raises(RepresentationError, match="no checkpoint.msgpack"):
        load_representation(tmp_path)


def tiny_run(algorithm: str, out: Path, broker_url: str, **options) -> Path:
    run_simulation(RunConfig.of(algorithm=algorithm, dataset="digits", clients=3, rounds=1, out=str(out),
                                broker=broker_url, workers=1, **options))
    return out


@pytest.mark.integration
def test_a_repper_run_loads_with_its_statistics_and_exports_fp32_and_int8(tmp_path: Path, mosquitto) -> None:
    # Prepare
    run_dir = tiny_run("repper", tmp_path / "run", mosquitto.url)
    saved = checkpoint.load(run_dir / "checkpoint.msgpack")

    # Execute
    representation = load_representation(run_dir)
    summary = export_run(run_dir, tmp_path / "release" / "representation.onnx", quantize="int8")

    # Assert
    body = representation.body
    assert not body.training
    for key in statistics_keys(body) | {"0.weight"}:
        np.testing.assert_array_equal(body.state_dict()[key].numpy(), saved.state["shared"][f"body.{key}"])
    assert representation.metadata == {
        "format": "edgepfl-representation/1", "input_shape": [1, 8, 8],
        "normalization": {"mean": [0.3053], "std": [0.376]}, "feature_dim": 128,
        "class_names": [str(i) for i in range(10)], "algorithm": "repper", "run_id": saved.run_id,
        "round": 1, "dataset": "digits", "model": "cnn8"}
    assert summary["path"] == str(tmp_path / "release" / "representation.onnx")
    assert summary["max_abs_diff"] <= 1e-4 and summary["precision"] == "fp32"
    assert summary["metadata"] == {**representation.metadata, "weights_sha256": weights_sha256(body)}
    int8 = summary["int8"]
    assert int8["path"] == str(int8_path(summary["path"])) == str(tmp_path / "release" / "representation.int8.onnx")
    assert int8["ratio_to_fp32"] <= 0.3 and int8["feature_correlation"] >= 0.999
    assert abs(int8["accuracy_change_points"]) <= 2.0
    assert int8["probe_accuracy_fp32"] >= 0.5
    json.dumps(summary)


@pytest.mark.integration
def test_a_fedavg_run_is_refused_for_lack_of_batchnorm_statistics(tmp_path: Path, mosquitto) -> None:
    # Prepare
    run_dir = tiny_run("fedavg", tmp_path / "run", mosquitto.url)

    # Execute
    with pytest.raises(RepresentationError) as error:
        load_representation(run_dir)
    with pytest.raises(RepresentationError):
        export_run(run_dir, tmp_path / "out.onnx")

    # Assert
    message = str(error.value)
    assert "BatchNorm running statistics" in message and "body.1.running_mean" in message
    assert "--release" in message and "fedavg" in message
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.integration
def test_a_released_fedper_run_exports_with_the_pooled_statistics_of_its_global_body(tmp_path: Path, mosquitto) -> None:
    # Prepare
    run_dir = tiny_run("fedper", tmp_path / "run", mosquitto.url, release=True)
    saved = checkpoint.load(run_dir / "checkpoint.msgpack")
    devices = [load_client_data("digits", num_clients=3, index=i) for i in range(3)]

    # Execute
    representation = load_representation(run_dir)

    # Assert: the statistics are those of the global body over the union of the devices' data
    # (the first layer's exactly; deeper layers pool per-device statistics, an approximation)
    body = representation.body
    shared = saved.state["shared"]
    for key in set(body.state_dict()) - statistics_keys(body):
        np.testing.assert_array_equal(body.state_dict()[key].numpy(), shared[f"body.{key}"])
    with torch.no_grad():
        first_conv = body[0](torch.from_numpy(np.concatenate([d.train_x for d in devices])))
    union_mean = first_conv.mean(dim=(0, 2, 3)).numpy()
    union_var = first_conv.var(dim=(0, 2, 3)).numpy()
    np.testing.assert_allclose(body.state_dict()["1.running_mean"].numpy(), union_mean, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(body.state_dict()["1.running_var"].numpy(), union_var, rtol=1e-2, atol=1e-5)
    release = json.loads((run_dir / "report.json").read_text())["release"]
    assert release["sha256"] == hashlib.sha256((run_dir / "release" / "representation.onnx").read_bytes()).hexdigest()


@pytest.mark.integration
def test_a_release_of_a_personal_body_is_refused_before_training(tmp_path: Path, mosquitto) -> None:
    # Execute
    with pytest.raises(ConfigError, match="release: lg_fedavg keeps the body personal"):
        tiny_run("lg_fedavg", tmp_path / "run", mosquitto.url, release=True)

    # Assert
    assert not (tmp_path / "run" / "checkpoint.msgpack").exists()
