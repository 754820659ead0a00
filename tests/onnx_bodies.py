"""Small representations (ONNX bodies: input `input`, output `features`) built with onnx.helper,
for the weak-device tests of feature-vector and signal tasks: no torch, no export needed.

- `dense_body`: flatten, a seeded random dense layer, ReLU (a random-features body).
- `spectrum_body`: the magnitude of each channel's discrete Fourier transform (a fixed
  frequency-content body, what a trained 1-D network learns to look at).
Both carry the metadata an exported body has (input shape, normalization, class names,
feature dimension, and the task unless asked not to).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edge_sdk.data import TaskSpec

OPSET = 17


def _model(task: TaskSpec, nodes: list, initializers: list, feature_dim: int, with_task: bool = True) -> bytes:
    batch = "N"
    graph = helper.make_graph(
        nodes, "body", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, *task.input_shape])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [batch, feature_dim])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    metadata = {"input_shape": list(task.input_shape),
                "normalization": {"mean": list(task.mean), "std": list(task.std)},
                "class_names": list(task.class_names), "feature_dim": feature_dim}
    if with_task:
        metadata["task"] = task.to_plain()
    for key, value in metadata.items():
        model.metadata_props.add(key=key, value=json.dumps(value))
    onnx.checker.check_model(model)
    return model.SerializeToString()


def dense_body(task: TaskSpec, hidden: int = 128, seed: int = 0, *, with_task: bool = True) -> bytes:
    """relu(flatten(x) @ W + b), W ~ N(0, 1/fan_in) from `seed`: an ONNX body of `hidden` features
    (its metadata has a `task` entry unless `with_task` is false)."""
    rng = np.random.default_rng(seed)
    fan_in = int(np.prod(task.input_shape))
    weights = (rng.normal(0.0, 1.0, (fan_in, hidden)) / np.sqrt(fan_in)).astype(np.float32)
    bias = rng.normal(0.0, 0.1, hidden).astype(np.float32)
    nodes = [helper.make_node("Flatten", ["input"], ["flat"], axis=1),
             helper.make_node("MatMul", ["flat", "W"], ["linear"]),
             helper.make_node("Add", ["linear", "b"], ["shifted"]),
             helper.make_node("Relu", ["shifted"], ["features"])]
    return _model(task, nodes, [numpy_helper.from_array(weights, "W"), numpy_helper.from_array(bias, "b")], hidden,
                  with_task)


def spectrum_body(task: TaskSpec) -> bytes:
    """|DFT| of each channel of signals [N, C, L]: C * (L // 2 + 1) features."""
    channels, length = task.input_shape
    bins = length // 2 + 1
    angle = 2 * np.pi * np.outer(np.arange(length), np.arange(bins)) / length
    nodes = [helper.make_node("MatMul", ["input", "cos"], ["re"]),
             helper.make_node("MatMul", ["input", "sin"], ["im"]),
             helper.make_node("Mul", ["re", "re"], ["re2"]),
             helper.make_node("Mul", ["im", "im"], ["im2"]),
             helper.make_node("Add", ["re2", "im2"], ["power"]),
             helper.make_node("Sqrt", ["power"], ["magnitude"]),
             helper.make_node("Flatten", ["magnitude"], ["features"], axis=1)]
    initializers = [numpy_helper.from_array(np.cos(angle).astype(np.float32), "cos"),
                    numpy_helper.from_array(np.sin(angle).astype(np.float32), "sin")]
    return _model(task, nodes, initializers, channels * bins)
