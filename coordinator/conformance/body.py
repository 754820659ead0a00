"""The representation the kit releases to a weak device: a small real ONNX model.

A seeded random-features body (flatten, dense, ReLU) for the device's task, built with
onnx.helper: input `input` float32 [N, *input_shape], output `features` float32 [N, d], and the
metadata an exported body carries (docs/PROTOCOL.md section 10). Training a body is not what
the kit checks; fetching, verifying and personalizing on one is.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edge_sdk.data import TaskSpec

OPSET = 17


def random_features_body(task: TaskSpec, features: int = 32, seed: int = 0) -> bytes:
    """relu(flatten(x) @ W + b), W ~ N(0, 1/fan_in) from `seed`, as ONNX bytes."""
    rng = np.random.default_rng(seed)
    fan_in = int(np.prod(task.input_shape))
    weights = (rng.normal(0.0, 1.0, (fan_in, features)) / np.sqrt(fan_in)).astype(np.float32)
    bias = rng.normal(0.0, 0.1, features).astype(np.float32)
    nodes = [helper.make_node("Flatten", ["input"], ["flat"], axis=1),
             helper.make_node("MatMul", ["flat", "W"], ["linear"]),
             helper.make_node("Add", ["linear", "b"], ["shifted"]),
             helper.make_node("Relu", ["shifted"], ["features"])]
    graph = helper.make_graph(
        nodes, "body", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", *task.input_shape])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", features])],
        [numpy_helper.from_array(weights, "W"), numpy_helper.from_array(bias, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    for key, value in release_metadata(task, features).items():
        model.metadata_props.add(key=key, value=json.dumps(value))
    onnx.checker.check_model(model)
    return model.SerializeToString()


def release_metadata(task: TaskSpec, features: int) -> dict:
    """What a RELEASE manifest's `metadata` and the body's metadata_props say."""
    return {"input_shape": list(task.input_shape), "normalization": {"mean": list(task.mean), "std": list(task.std)},
            "class_names": list(task.class_names), "feature_dim": features, "task": task.to_plain()}
