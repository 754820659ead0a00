"""One ONNX file per device: the released body and a personal head, composed without torch.

A head model takes `features` [N, d] and outputs `label` (int64 [N], a class index) and
`probabilities` (float32 [N, C], one column per class of the dataset in class-index order,
zeros for classes the head never saw). `merge_body_and_head` wires the body's `features` into
the head's input, so the composed model maps `input` samples (images, signals or feature
vectors) to `label` and `probabilities`.

Heads are written with onnx.helper: dense layers for the linear and MLP heads
(`dense_head_to_onnx`), class means (`ncm_head_to_onnx`), or any ONNX model that outputs
per-class scores (`scores_to_classifier`, which the torch-side export uses for torch heads).

Decisions:
- Every head's `probabilities` is the softmax of its scores. For a linear SVM, which has no
  probabilities of its own, they rank classes like the SVM does and sum to 1, but are not
  calibrated (a binary SVM's single score s is the pair (0, s), so P(class 1) = sigmoid(s)).
- A head fitted on a subset of the classes gets its K columns scattered into C by a 0/1 matrix
  product (exact: each output is one input times 1 plus zeros); `label` is the class index of
  the highest score (ArgMax, then Gather).
- The composed model's metadata is the body's, then the caller's (e.g. `head`), then `format`
  "edgepfl-personalized/1" and `num_classes`, JSON-encoded like the body's.

Nothing here (or in anything it imports) imports torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.compose
import onnx.version_converter
from onnx import TensorProto, helper, numpy_helper

from ..store import write_atomic

log = logging.getLogger(__name__)

INPUT = "input"
FEATURES = "features"
LABEL = "label"
PROBABILITIES = "probabilities"
BATCH = "batch"
OPSET = 17
FORMAT = "edgepfl-personalized/1"
HEAD_PREFIX = "head/"
_RAW_SCORES = "raw_scores"


class ComposeError(ValueError):
    """A body or head model that does not follow the contract, or that cannot be combined."""


# -- small graph utilities ------------------------------------------------------------------
def _opset(model: onnx.ModelProto) -> int | None:
    """The model's default-domain ("" or "ai.onnx") opset version."""
    versions = [entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")]
    return max(versions) if versions else None


def _dedupe_opsets(model: onnx.ModelProto) -> None:
    """Keep one opset_import entry per domain (the highest version); some converters repeat them."""
    versions: dict[str, int] = {}
    for entry in model.opset_import:
        domain = "" if entry.domain == "ai.onnx" else entry.domain
        versions[domain] = max(versions.get(domain, 0), entry.version)
    del model.opset_import[:]
    model.opset_import.extend(helper.make_opsetid(domain, version) for domain, version in versions.items())


def _rename(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Rename the value `old` to `new` everywhere in `graph` (nodes, outputs, value_info)."""
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        node.output[:] = [new if name == old else name for name in node.output]
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.name == old:
            value.name = new


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    return copied


def _load(model: onnx.ModelProto | bytes | str | Path) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return onnx.load(str(model))


def _metadata(model: onnx.ModelProto) -> dict[str, Any]:
    return {prop.key: json.loads(prop.value) for prop in model.metadata_props}


def _align_opset(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """`model` at default-domain opset `version`: relabelled when none of its operators changed
    between the two versions, converted with onnx's version converter otherwise."""
    current = _opset(model)
    if current is None or current == version:
        return model
    unchanged = all(
        onnx.defs.get_schema(node.op_type, current, "").since_version
        == onnx.defs.get_schema(node.op_type, version, "").since_version
        for node in model.graph.node
        if node.domain in ("", "ai.onnx")
    )
    if not unchanged:
        return onnx.version_converter.convert_version(model, version)
    model = _copy(model)
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = version
    return model


def _check_classes(classes: np.ndarray, num_classes: int) -> np.ndarray:
    classes = np.asarray(classes)
    if classes.ndim != 1 or classes.size == 0:
        raise ComposeError(f"classes must be a non-empty list, got shape {list(classes.shape)}")
    as_int = classes.astype(np.int64)
    if not np.array_equal(as_int, classes) or as_int.min() < 0 or as_int.max() >= num_classes:
        raise ComposeError(f"classes must be class indices in 0..{num_classes - 1}, got {classes.tolist()}")
    if np.unique(as_int).size != as_int.size:
        raise ComposeError(f"classes must be distinct, got {classes.tolist()}")
    return as_int


# -- heads ----------------------------------------------------------------------------------
def scores_to_classifier(model: onnx.ModelProto, *, scores: str, classes: np.ndarray,
                         num_classes: int) -> onnx.ModelProto:
    """A copy of `model` whose outputs are `label` and `probabilities` over `num_classes` classes.

    `scores` names an output [N, K] with one column per entry of `classes` (class indices, in
    column order): `probabilities` is its softmax scattered into C columns, `label` is
    `classes[argmax(scores)]`.
    """
    classes = _check_classes(classes, num_classes)
    model = _copy(model)
    graph = model.graph
    outputs = {value.name for value in graph.output}
    if scores not in outputs:
        raise ComposeError(f"the head model has outputs {sorted(outputs)}, not {scores!r}")
    if scores != _RAW_SCORES:
        _rename(graph, scores, _RAW_SCORES)
    graph.node.append(helper.make_node("Softmax", [_RAW_SCORES], ["classes/softmax"], axis=1))
    if np.array_equal(classes, np.arange(num_classes)):
        graph.node.append(helper.make_node("Identity", ["classes/softmax"], [PROBABILITIES]))
    else:
        scatter = np.zeros((classes.size, num_classes), dtype=np.float32)
        scatter[np.arange(classes.size), classes] = 1.0
        graph.initializer.append(numpy_helper.from_array(scatter, "classes/scatter"))
        graph.node.append(helper.make_node("MatMul", ["classes/softmax", "classes/scatter"], [PROBABILITIES]))
    graph.initializer.append(numpy_helper.from_array(classes, "classes/index"))
    graph.node.append(helper.make_node("ArgMax", [_RAW_SCORES], ["classes/argmax"], axis=1, keepdims=0))
    graph.node.append(helper.make_node("Gather", ["classes/index", "classes/argmax"], [LABEL], axis=0))
    del graph.output[:]
    graph.output.extend([
        helper.make_tensor_value_info(LABEL, TensorProto.INT64, [BATCH]),
        helper.make_tensor_value_info(PROBABILITIES, TensorProto.FLOAT, [BATCH, num_classes]),
    ])
    onnx.checker.check_model(model)
    return model


def _features_input(feature_dim: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(FEATURES, TensorProto.FLOAT, [BATCH, feature_dim])


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """A model of `graph` at OPSET with the oldest IR version that supports it, which every
    onnxruntime able to run OPSET loads (onnx's newest IR version can be newer than theirs)."""
    opsets = [helper.make_opsetid("", OPSET)]
    return helper.make_model(graph, opset_imports=opsets, producer_name="edgepfl",
                             ir_version=helper.find_min_ir_version_for(opsets))


def dense_head_to_onnx(layers: Sequence[tuple[np.ndarray, np.ndarray]], classes: np.ndarray,
                       num_classes: int) -> onnx.ModelProto:
    """Dense layers (weights [in, out], bias [out]; ReLU between them, Gemm each) as a head model:
    the last layer's columns score `classes` (class indices), `probabilities` is their softmax
    over `num_classes` columns and `label` the class of the highest score."""
    if not layers:
        raise ComposeError("a dense head needs at least one layer")
    nodes, initializers, value, width = [], [], FEATURES, np.shape(layers[0][0])[0]
    for index, (weights, bias) in enumerate(layers):
        weights, bias = np.asarray(weights, dtype=np.float32), np.asarray(bias, dtype=np.float32)
        if weights.ndim != 2 or weights.shape[0] != width or bias.shape != weights.shape[1:]:
            raise ComposeError(f"layer {index}: weights [{width}, out] and bias [out] expected, "
                               f"got {list(weights.shape)} and {list(bias.shape)}")
        width = weights.shape[1]
        if not (np.isfinite(weights).all() and np.isfinite(bias).all()):
            raise ComposeError(f"layer {index}: weights and bias must be finite")
        if index:
            nodes.append(helper.make_node("Relu", [value], [f"dense/relu{index}"]))
            value = f"dense/relu{index}"
        output = _RAW_SCORES if index == len(layers) - 1 else f"dense/layer{index}"
        nodes.append(helper.make_node("Gemm", [value, f"dense/weights{index}", f"dense/bias{index}"], [output]))
        initializers += [numpy_helper.from_array(weights, f"dense/weights{index}"),
                         numpy_helper.from_array(bias, f"dense/bias{index}")]
        value = output
    if width != np.size(classes):
        raise ComposeError(f"the last layer scores {width} classes, {np.size(classes)} are named")
    graph = helper.make_graph(nodes, "dense_head", [_features_input(np.shape(layers[0][0])[0])],
                              [helper.make_tensor_value_info(_RAW_SCORES, TensorProto.FLOAT, [BATCH, width])],
                              initializers)
    return scores_to_classifier(_model(graph), scores=_RAW_SCORES, classes=classes, num_classes=num_classes)


def ncm_head_to_onnx(means: np.ndarray, present: np.ndarray) -> onnx.ModelProto:
    """Nearest class mean: the label is the present class whose mean is closest (Euclidean) to the
    features; probabilities = softmax(-squared distance) over the present classes, 0 elsewhere.

    Squared distances are computed as |f|^2 - 2 f.m + |m|^2 (one MatMul, memory N x C).
    """
    means = np.asarray(means, dtype=np.float32)
    present = np.asarray(present, dtype=bool)
    if means.ndim != 2 or present.shape != (means.shape[0],):
        raise ComposeError(f"means [C, d] and present [C] expected, got {list(means.shape)} and {list(present.shape)}")
    if not present.any():
        raise ComposeError("an ncm head needs at least one present class")
    if not np.isfinite(means[present]).all():
        raise ComposeError("class means must be finite")
    classes = np.flatnonzero(present)
    kept = means[classes]
    graph = helper.make_graph(
        [
            helper.make_node("Mul", [FEATURES, FEATURES], ["ncm/squares"]),
            helper.make_node("ReduceSum", ["ncm/squares", "ncm/axis"], ["ncm/norms"], keepdims=1),
            helper.make_node("MatMul", [FEATURES, "ncm/means2"], ["ncm/dots2"]),
            helper.make_node("Add", ["ncm/norms", "ncm/mean_norms"], ["ncm/sum"]),
            helper.make_node("Sub", ["ncm/dots2", "ncm/sum"], [_RAW_SCORES]),  # -|f - m|^2
        ],
        "ncm_head",
        [_features_input(means.shape[1])],
        [helper.make_tensor_value_info(_RAW_SCORES, TensorProto.FLOAT, [BATCH, classes.size])],
        [
            numpy_helper.from_array(np.array([1], dtype=np.int64), "ncm/axis"),
            numpy_helper.from_array(np.ascontiguousarray(2.0 * kept.T), "ncm/means2"),
            numpy_helper.from_array((kept * kept).sum(1, dtype=np.float32).reshape(1, -1), "ncm/mean_norms"),
        ],
    )
    return scores_to_classifier(_model(graph), scores=_RAW_SCORES, classes=classes, num_classes=means.shape[0])


# -- body + head ----------------------------------------------------------------------------
def merge_body_and_head(
    body: onnx.ModelProto,
    head: onnx.ModelProto,
    *,
    head_input: str,
    num_classes: int,
    metadata: Mapping[str, Any],
) -> onnx.ModelProto:
    """One model: the body's `input` -> `features` -> the head's `head_input` -> `label`,
    `probabilities`. Neither argument is modified."""
    body_inputs = [value.name for value in body.graph.input]
    body_outputs = [value.name for value in body.graph.output]
    if body_inputs != [INPUT] or FEATURES not in body_outputs:
        raise ComposeError(f"the body must map {INPUT!r} to {FEATURES!r}; it has inputs {body_inputs}, "
                           f"outputs {body_outputs}")
    head_inputs = [value.name for value in head.graph.input]
    head_outputs = {value.name: value for value in head.graph.output}
    if head_inputs != [head_input]:
        raise ComposeError(f"the head must have the single input {head_input!r}, it has {head_inputs}")
    if set(head_outputs) != {LABEL, PROBABILITIES}:
        raise ComposeError(f"the head must output {LABEL!r} and {PROBABILITIES!r}, it has {sorted(head_outputs)}")
    if head_outputs[LABEL].type.tensor_type.elem_type != TensorProto.INT64:
        raise ComposeError(f"the head's {LABEL!r} must be int64")
    dims = head_outputs[PROBABILITIES].type.tensor_type.shape.dim
    if len(dims) == 2 and dims[1].HasField("dim_value") and dims[1].dim_value != num_classes:
        raise ComposeError(f"the head gives {dims[1].dim_value} probabilities, the dataset has {num_classes} classes")
    version = _opset(body)
    if version is None:
        raise ComposeError("the body imports no default-domain opset")
    body, head = _copy(body), _align_opset(_copy(head), version)
    body_metadata = _metadata(body)
    ir_version = max(body.ir_version, head.ir_version)
    for model in (body, head):
        model.ir_version = ir_version
        del model.metadata_props[:]
        _dedupe_opsets(model)
    merged = onnx.compose.merge_models(body, head, io_map=[(FEATURES, head_input)], outputs=None,
                                       prefix2=HEAD_PREFIX, producer_name="edgepfl", producer_version="1")
    for name in (LABEL, PROBABILITIES):
        _rename(merged.graph, HEAD_PREFIX + name, name)
    _dedupe_opsets(merged)
    helper.set_model_props(merged, {
        key: json.dumps(value)
        for key, value in {**body_metadata, **metadata, "format": FORMAT, "num_classes": num_classes}.items()
    })
    outputs = [value.name for value in merged.graph.output]
    if outputs != [LABEL, PROBABILITIES]:
        raise ComposeError(f"the merged model has outputs {outputs}")
    return merged


def compose(
    body: onnx.ModelProto | bytes | str | Path,
    head_model: onnx.ModelProto,
    out_path: str | Path,
    *,
    num_classes: int,
    metadata: Mapping[str, Any],
) -> Path:
    """Merge `body` (a model, its bytes or its path) with `head_model` (whose single input is the
    features), check the result with onnx.checker and write it atomically to `out_path`."""
    head_inputs = [value.name for value in head_model.graph.input]
    if len(head_inputs) != 1:
        raise ComposeError(f"the head must have a single input, it has {head_inputs}")
    merged = merge_body_and_head(_load(body), head_model, head_input=head_inputs[0], num_classes=num_classes,
                                 metadata=metadata)
    onnx.checker.check_model(merged, full_check=True)
    out_path = Path(out_path)
    data = merged.SerializeToString()
    write_atomic(out_path, data)
    log.info("composed %s (%d bytes, head %s)", out_path, len(data), metadata.get("head", "?"))
    return out_path
