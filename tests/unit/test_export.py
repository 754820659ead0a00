"""ONNX export of bodies, int8 quantization and exporting a run's representation.

The exported file must compute what the PyTorch module computes (checked here independently
of the exporter's own parity check), on random and on real samples, at any batch size, for
images [C, H, W], signals [C, L] and feature vectors [D]; a bad export must raise and leave
nothing behind; int8 must be much smaller and stay close, sit at the path asked for, and say
which operators stayed in float. The representation of a real RepPer run loads with its
BatchNorm statistics and `edgepfl export` reproduces the release; a FedAvg run, which keeps
them on the devices, is refused with a message that says so. `export/` never imports the
coordinator, and `edge_sdk/` imports neither.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import cast

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from threadpoolctl import threadpool_limits
from torch import nn

from sklearn.datasets import load_breast_cancer

from coordinator.cli import main
from coordinator.commands.export import export_run, load_representation
from coordinator.config.run_config import RunConfig
from coordinator.hosting.simulate import run_simulation
from coordinator.releases.representation import RepresentationError
from edge_sdk.config import ConfigError
from edge_sdk.data import BUILTIN_TASKS, load_client_data, load_dataset
from edge_sdk.models import build_body, statistics_keys
from edge_sdk.training import recalibrate_batchnorm
from export import (
    ExportMismatchError,
    export_body,
    export_module,
    fp32_path,
    operator_precision,
    quantize_int8,
)
from export.onnx_export import weights_sha256
from saved_runs import checkpoint_at

SIZES = {"cnn8": 8, "cnn28": 28}
REPO = Path(__file__).resolve().parents[2]


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
    body, _ = build_body(name, dataclasses.replace(BUILTIN_TASKS["digits"], input_shape=tuple(x.shape[1:])))
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
    source = {node.output[0]: node.input[0] for node in graph.node
              if node.op_type in ("QuantizeLinear", "DequantizeLinear")}
    conv_reads = {source.get(source.get(name)) for node in graph.node if node.op_type == "Conv" for name in node.input}
    quantized = [node.input[0] for node in graph.node if node.op_type == "QuantizeLinear"]
    assert quantized
    for value in quantized:
        assert producer.get(value) in (None, "Conv") or value in conv_reads, \
            f"{producer[value]} output {value} is quantized"
    assert any(producer.get(value) == "Mul" for value in quantized)  # the stem's hard-swish feeds the second conv
    assert not any(producer.get(value) in ("Add", "ReduceMean") for value in quantized)


class SignalBody(nn.Module):
    """A 1-D convolutional body for signals [C, L]: conv, BatchNorm, ReLU, pooled to [N, 16]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Conv1d(channels, 8, 5, padding=2), nn.BatchNorm1d(8), nn.ReLU(),
                                    nn.Conv1d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def tabular() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's breast cancer features [569, 30], standardized, and their labels."""
    x, y = load_breast_cancer(return_X_y=True)
    return ((x - x.mean(axis=0)) / x.std(axis=0)).astype(np.float32), y.astype(np.int64)


def signals(count: int) -> np.ndarray:
    """Seeded synthetic 3-channel sensor windows [count, 3, 64]: two sines and noise."""
    rng = np.random.default_rng(3)
    t = np.linspace(0, 1, 64, dtype=np.float32)
    frequency = rng.uniform(1, 8, size=(count, 1, 1)).astype(np.float32)
    waves = np.sin(2 * np.pi * frequency * t + rng.uniform(0, np.pi, size=(count, 3, 1)))
    return (waves + 0.1 * rng.standard_normal((count, 3, 64))).astype(np.float32)


def signal_body() -> tuple[nn.Module, np.ndarray]:
    torch.manual_seed(0)
    body, x = SignalBody(3), signals(300)
    recalibrate_batchnorm(body, torch.from_numpy(x[:200]))
    return body.eval(), x


def tabular_body() -> tuple[nn.Module, np.ndarray]:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
    return body.eval(), tabular()[0]


@pytest.mark.parametrize("kind", ["signal", "features"])
def test_signal_and_feature_bodies_export_with_a_dynamic_batch_and_quantize(tmp_path: Path, kind: str) -> None:
    # Prepare
    body, x = signal_body() if kind == "signal" else tabular_body()
    task = {"kind": kind, "input_shape": list(x.shape[1:])}
    out = tmp_path / f"{kind}.onnx"

    # Execute
    fp32 = export_body(body, x.shape[1:], out, metadata={"task": task}, samples=x[:128])
    int8 = export_body(body, x.shape[1:], tmp_path / f"{kind}.int8.onnx", metadata={"task": task},
                       quantize="int8", samples=x[:128])

    # Assert
    runner = session(out)
    assert runner.get_inputs()[0].shape == ["batch", *x.shape[1:]]
    for batch in (1, 5, 150):
        (features,) = runner.run(None, {"input": x[-batch:]})
        np.testing.assert_allclose(features, torch_features(body, x[-batch:]), atol=1e-4)
    assert fp32["max_abs_diff"] <= 1e-4 and set(fp32["parity"]) == {"random batch of 1", "random batch of 7",
                                                                     "check_inputs"}
    assert fp32["metadata"]["task"] == task and fp32["metadata"]["input_shape"] == list(x.shape[1:])
    assert fp32["metadata"]["feature_dim"] == torch_features(body, x[:1]).shape[1]
    assert int8["int8"]["feature_correlation"] >= 0.99
    assert int8["int8"]["calibration_inputs"] == "128 real samples"
    assert quantize_nodes(tmp_path / f"{kind}.int8.onnx") > 0


def test_int8_sits_at_the_out_path_and_fp32_beside_it_only_when_asked(tmp_path: Path) -> None:
    # Prepare
    body, x = tabular_body()
    y = tabular()[1]
    plain, both = tmp_path / "plain" / "model.onnx", tmp_path / "both" / "model.onnx"

    # Execute
    alone = export_body(body, (30,), plain, metadata={}, quantize="int8", samples=x[:200], held_out=(x[200:], y[200:]))
    kept = export_body(body, (30,), both, metadata={}, quantize="int8", also_fp32=True)

    # Assert
    assert [p.name for p in plain.parent.iterdir()] == ["model.onnx"] and quantize_nodes(plain) > 0
    assert sorted(p.name for p in both.parent.iterdir()) == ["model.fp32.onnx", "model.onnx"]
    assert fp32_path(both) == both.parent / "model.fp32.onnx" and quantize_nodes(fp32_path(both)) == 0
    assert [(f["precision"], f["size_bytes"]) for f in kept["files"]] == [
        ("int8", both.stat().st_size), ("fp32", fp32_path(both).stat().st_size)]
    assert kept["sha256"] == hashlib.sha256(both.read_bytes()).hexdigest()
    assert alone["metadata"]["quantization"] == "int8-qdq-per-channel"
    assert alone["int8"]["agreement_inputs"] == f"{len(y) - 200} held-out real samples"
    assert 0.0 <= alone["int8"]["probe_prediction_agreement"] <= 1.0 and alone["int8"]["probe_accuracy_fp32"] > 0.8
    assert kept["int8"]["calibration_inputs"] == "256 seeded random samples"
    assert "probe_accuracy_int8" not in kept["int8"]


def test_the_operators_int8_leaves_in_float_are_named(tmp_path: Path) -> None:
    # Prepare: conv (quantized), then ReLU, global pooling and flatten (no weights: left in float)
    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()

    # Execute
    summary = export_body(body, (1, 8, 8), tmp_path / "body.onnx", metadata={}, quantize="int8",
                          samples=digits_at(8)[:64])

    # Assert
    int8 = summary["int8"]
    assert int8["quantized_operators"] == {"Conv": 1}
    assert int8["left_in_float"] == {"Relu": 1, "GlobalAveragePool": 1, "Flatten": 1}
    assert int8["left_in_float_text"] == "left in float: Relu x1, GlobalAveragePool x1, Flatten x1"


def test_a_weighted_operator_not_fed_by_dequantize_counts_as_float() -> None:
    # Prepare: Conv A reads dequantized input and weights; Conv B reads the raw float input
    helper = onnx.helper
    nodes = [
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["x"]),
        helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["w"]),
        helper.make_node("Conv", ["x", "w"], ["a"]),
        helper.make_node("Conv", ["raw", "w"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["sum"]),
        helper.make_node("QuantizeLinear", ["sum", "s", "z"], ["out"]),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [], []))

    # Execute
    precision = operator_precision(model)

    # Assert
    assert precision.quantized == {"Conv": 1}
    assert precision.left_in_float == {"Conv": 1, "Add": 1}
    assert precision.describe() == "left in float: Conv x1, Add x1"


def test_bad_shapes_and_options_are_refused_by_name(tmp_path: Path) -> None:
    # Prepare
    body, _ = tabular_body()
    unflattened = nn.Conv1d(3, 4, 3)

    # Execute / Assert
    with pytest.raises(ValueError, match=r"input_shape must be \[D\], \[C, L\] or \[C, H, W\].*\[1, 1, 8, 8\]"):
        export_body(body, (1, 1, 8, 8), tmp_path / "a.onnx", metadata={})
    with pytest.raises(ValueError, match=r"must map \[N, 3, 16\] to features \[N, d\]; this one gives \[2, 4, 14\]"):
        export_body(unflattened, (3, 16), tmp_path / "b.onnx", metadata={})
    with pytest.raises(ValueError, match="also_fp32"):
        export_body(body, (30,), tmp_path / "c.onnx", metadata={}, also_fp32=True)
    assert list(tmp_path.iterdir()) == []


def test_the_export_help_says_where_int8_and_fp32_go(capsys: pytest.CaptureFixture[str]) -> None:
    # Execute
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--help"])

    # Assert
    shown = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0
    assert "--also-fp32" in shown and "<stem>.fp32.onnx beside --out" in shown
    assert "write a static int8 QDQ model (per channel) at --out" in shown


def imported_modules(source: str, package: str) -> set[str]:
    """Every module a Python source of `package` imports, at any depth (inside functions too),
    relative imports resolved against the package."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
            names.add(".".join(part for part in (base, node.module or "") if part))
    return names


def test_the_import_scan_sees_imports_inside_functions_and_relative_ones() -> None:
    # Prepare
    source = "import numpy\ndef later():\n    from coordinator import checkpoint\n    from ..coordinator import x\n"

    # Execute
    names = imported_modules(source, "edge_sdk.lite")

    # Assert
    assert names == {"numpy", "coordinator", "edge_sdk.coordinator"}


@pytest.mark.parametrize("package, forbidden", [("export", {"coordinator"}), ("edge_sdk", {"export", "coordinator"})])
def test_imports_point_one_way_coordinator_export_edge_sdk(package: str, forbidden: set[str]) -> None:
    # Prepare
    files = sorted((REPO / package).rglob("*.py"))

    # Execute
    offending = {}
    for path in files:
        relative = path.relative_to(REPO)
        imported = imported_modules(path.read_text(), ".".join(relative.parts[:-1]))
        offending[str(relative)] = sorted(name for name in imported if name.split(".")[0] in forbidden)

    # Assert
    assert len(files) > 3
    assert {path: names for path, names in offending.items() if names} == {}


def test_a_run_needs_a_checkpoint_and_contradicting_options_are_refused_first(tmp_path: Path) -> None:
    # Execute / Assert
    with pytest.raises(RepresentationError, match="no checkpoint.msgpack"):
        load_representation(tmp_path)
    with pytest.raises(ValueError, match="also_fp32 .* needs quantize='int8'"):
        export_run(tmp_path, tmp_path / "out.onnx", also_fp32=True)
    with pytest.raises(ValueError, match="fp16 and int8 exclude each other"):
        export_run(tmp_path, tmp_path / "out.onnx", quantize="int8", fp16=True)
    assert list(tmp_path.iterdir()) == []


def tiny_run(algorithm: str, out: Path, broker_url: str, **options) -> Path:
    run_simulation(RunConfig.of(algorithm=algorithm, dataset="digits", clients=3, rounds=1, out=str(out),
                                broker=broker_url, workers=1, **options))
    return out


def quantize_nodes(path: Path) -> int:
    return sum(node.op_type == "QuantizeLinear" for node in onnx.load(str(path)).graph.node)


@pytest.mark.integration
def test_a_repper_run_loads_with_its_statistics_and_the_export_command_reproduces_its_release(
        tmp_path: Path, mosquitto, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare
    run_dir = tiny_run("repper", tmp_path / "run", mosquitto.url)
    saved = checkpoint_at(run_dir / "checkpoint.msgpack")
    released = (run_dir / "release" / "representation.onnx").read_bytes()
    out, alone = tmp_path / "export" / "body.onnx", tmp_path / "alone" / "body.onnx"

    # Execute
    representation = load_representation(run_dir)
    code = main(["export", "--run", str(run_dir), "--out", str(out), "--quantize", "int8", "--also-fp32"])
    summary = json.loads(capsys.readouterr().out)
    without_fp32 = export_run(run_dir, alone, quantize="int8", calibration_size=64)

    # Assert
    assert code == 0
    body = representation.body
    assert not body.training
    for key in statistics_keys(body) | {"0.weight"}:
        np.testing.assert_array_equal(body.state_dict()[key].numpy(), saved.state["shared"][f"body.{key}"])
    digits = load_dataset("digits").task
    assert representation.metadata == {
        "task": {"name": "digits", "kind": "image", "input_shape": [1, 8, 8], "num_classes": 10,
                 "class_names": list(digits.class_names), "mean": list(digits.mean), "std": list(digits.std)},
        "input_shape": [1, 8, 8], "normalization": {"mean": [0.3053], "std": [0.376]},
        "class_names": [str(i) for i in range(10)], "algorithm": "repper", "run_id": saved.run_id,
        "round": 1, "dataset": "digits", "model": "cnn8"}
    assert summary["path"] == str(out) and summary["precision"] == "int8" and quantize_nodes(out) > 0
    fp32 = fp32_path(out)
    assert [(f["path"], f["precision"], f["size_bytes"]) for f in summary["files"]] == [
        (str(out), "int8", out.stat().st_size), (str(fp32), "fp32", fp32.stat().st_size)]
    assert fp32.read_bytes() == released and quantize_nodes(fp32) == 0
    assert summary["max_abs_diff"] <= 1e-4 and "check_inputs" in summary["parity"]
    assert summary["metadata"] == {**representation.metadata, "format": "edgepfl-representation/1", "feature_dim": 128,
                                   "weights_sha256": weights_sha256(body), "quantization": "int8-qdq-per-channel"}
    int8 = summary["int8"]
    assert int8["ratio_to_fp32"] <= 0.3 and int8["feature_correlation"] >= 0.999
    assert abs(int8["accuracy_change_points"]) <= 2.0
    assert int8["probe_accuracy_fp32"] >= 0.5 and int8["agreement_inputs"].endswith("held-out real samples")
    assert int8["quantized_operators"]["Conv"] >= 1
    assert int8["left_in_float_text"].startswith("left in float: ")
    assert sorted(p.name for p in alone.parent.iterdir()) == ["body.onnx"] and quantize_nodes(alone) > 0
    assert [f["path"] for f in without_fp32["files"]] == [str(alone)]
    assert without_fp32["sha256"] == hashlib.sha256(alone.read_bytes()).hexdigest()


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
    saved = checkpoint_at(run_dir / "checkpoint.msgpack")
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
        first_conv = cast(nn.Sequential, body)[0](torch.from_numpy(np.concatenate([d.train_x for d in devices])))
    union_mean = first_conv.mean(dim=(0, 2, 3)).numpy()
    union_var = first_conv.var(dim=(0, 2, 3)).numpy()
    np.testing.assert_allclose(body.state_dict()["1.running_mean"].numpy(), union_mean, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(body.state_dict()["1.running_var"].numpy(), union_var, rtol=1e-2, atol=1e-5)
    release = json.loads((run_dir / "report.json").read_text())["release"]
    released = (run_dir / "release" / "representation.onnx").read_bytes()
    assert release["sha256"] == hashlib.sha256(released).hexdigest()
    assert export_run(run_dir, tmp_path / "again.onnx")["sha256"] == release["sha256"]  # from the saved statistics


@pytest.mark.integration
def test_a_release_of_a_personal_body_is_refused_before_training(tmp_path: Path, mosquitto) -> None:
    # Execute
    with pytest.raises(ConfigError, match="release: lg_fedavg keeps the body personal"):
        tiny_run("lg_fedavg", tmp_path / "run", mosquitto.url, release=True)

    # Assert
    assert not (tmp_path / "run" / "checkpoint.msgpack").exists()
