"""Static int8 quantization of an exported representation, for devices where size and speed matter.

onnxruntime's `quantize_static` in the QDQ format: weights int8 per output channel, activations
uint8 with ranges calibrated (MinMax) on normalized samples, images, signals or feature vectors
(U8S8, onnxruntime's recommended format on CPUs). Only the operators that carry weights (Conv,
MatMul, Gemm) are quantized: element-wise operators such as MobileNetV3's hard-swish (HardSigmoid, Mul)
and residual Adds stay float32 between them. Quantizing those too added a QDQ pair per operator,
made mobilenet_v3_small 3x slower at batch 1 and cost accuracy, while they hold no weights to shrink. The model
keeps float32 `input` and `features`, so it is a drop-in replacement for the fp32 file; its
metadata is the fp32 file's plus `quantization`. `quant_pre_process` (shape inference and
graph optimizations such as folding) runs first, as onnxruntime recommends for static
quantization. `operator_precision` says, per operator type, which nodes of the result were
quantized (a weighted operator whose inputs all come from DequantizeLinear) and which were left
in float (every other node but the QuantizeLinear/DequantizeLinear pairs themselves).

Weights use 7 of their 8 bits (`reduce_range`). On x86 CPUs with AVX2 but without VNNI,
onnxruntime's U8S8 kernels add pairs of uint8 x int8 products in 16 bits, which saturate with
full-range weights: on such a CPU (an AMD EPYC of family 23) cnn28's int8 features correlated
0.944 with fp32, 0.9995 with 7-bit weights. The model is made once and runs on devices whose
CPUs the coordinator does not know, so it is made safe for all of them; the file is no larger.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process

from edge_sdk.lite.features import decode_metadata
from edge_sdk.store import write_atomic

log = logging.getLogger(__name__)

CALIBRATION_BATCH = 32
WEIGHTED_OPERATORS = ("Conv", "MatMul", "Gemm")
QUANTIZATION = "int8-qdq-per-channel"
QUANTIZATION_PER_TENSOR = "int8-qdq-per-tensor"


@dataclass(frozen=True)
class OperatorPrecision:
    """Nodes of a quantized model counted by operator type: run on int8 inputs, or left in float."""

    quantized: dict[str, int]
    left_in_float: dict[str, int]

    def describe(self) -> str:
        """E.g. "left in float: GlobalAveragePool x1, Flatten x1" (or "left in float: none")."""
        listed = ", ".join(f"{op} x{count}" for op, count in self.left_in_float.items())
        return f"left in float: {listed or 'none'}"


@dataclass(frozen=True)
class QuantizeResult:
    """The int8 file written, its size against the fp32 one, and what was quantized."""

    path: Path
    sha256: str
    size_bytes: int
    ratio_to_fp32: float
    operators: OperatorPrecision
    metadata: dict[str, Any]
    """The metadata_props as written (decoded): the fp32 model's plus `quantization`."""


_QDQ = ("QuantizeLinear", "DequantizeLinear")


def operator_precision(model: onnx.ModelProto) -> OperatorPrecision:
    """Count the compute nodes of a QDQ model: a weighted operator (WEIGHTED_OPERATORS) all of
    whose inputs come from DequantizeLinear runs on int8 values; any other node (element-wise,
    pooling, reshaping, or a weighted one the quantizer skipped) is left in float. Counts are in
    the order the types first appear in the graph, and of the graph as written: onnxruntime may
    still fold a ReLU that sits between a DequantizeLinear and a QuantizeLinear into an integer
    kernel when it loads the model."""
    producer = {output: node.op_type for node in model.graph.node for output in node.output}
    quantized: dict[str, int] = {}
    left: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type in _QDQ:
            continue
        fed = all(producer.get(name) == "DequantizeLinear" for name in node.input if name)
        counts = quantized if node.op_type in WEIGHTED_OPERATORS and fed else left
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return OperatorPrecision(quantized, left)


class _ArrayReader(CalibrationDataReader):
    """Feeds `inputs` to the calibrator in batches of CALIBRATION_BATCH under the name `name`."""

    def __init__(self, name: str, inputs: np.ndarray):
        self._batches = iter([{name: np.ascontiguousarray(inputs[i:i + CALIBRATION_BATCH], dtype=np.float32)}
                              for i in range(0, len(inputs), CALIBRATION_BATCH)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)


def quantize_int8(
    fp32_path: str | Path,
    out_path: str | Path,
    calibration: np.ndarray,
    *,
    per_channel: bool = True,
) -> QuantizeResult:
    """Quantize the fp32 model at `fp32_path` to int8 (QDQ) at `out_path`.

    `calibration` [N, *input_shape] are normalized inputs like the ones the model will see (a
    few hundred are plenty). The output file is written atomically; its metadata_props are the
    fp32 model's plus `quantization` ("int8-qdq-per-channel", or "-per-tensor" without
    per_channel).
    """
    fp32_path, out_path = Path(fp32_path), Path(out_path)
    if len(calibration) == 0:
        raise ValueError("calibration needs at least one input")
    fp32 = onnx.load(str(fp32_path))
    input_name = fp32.graph.input[0].name
    with tempfile.TemporaryDirectory(prefix="edgepfl-quantize-") as tmp:
        prepared, quantized = Path(tmp) / "prepared.onnx", Path(tmp) / "int8.onnx"
        quant_pre_process(str(fp32_path), str(prepared))
        quantize_static(
            str(prepared), str(quantized), _ArrayReader(input_name, calibration),
            quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
            per_channel=per_channel, reduce_range=True, op_types_to_quantize=list(WEIGHTED_OPERATORS),
        )
        model = onnx.load(str(quantized))
    tag = QUANTIZATION if per_channel else QUANTIZATION_PER_TENSOR
    props = {**{p.key: p.value for p in fp32.metadata_props}, "quantization": json.dumps(tag)}
    onnx.helper.set_model_props(model, props)
    data = model.SerializeToString()
    write_atomic(out_path, data)
    result = QuantizeResult(out_path, hashlib.sha256(data).hexdigest(), len(data), len(data) / fp32_path.stat().st_size,
                            operator_precision(model), decode_metadata(props))
    log.info("quantized %s -> %s (%d bytes, %.2fx the fp32 size; %s)", fp32_path, out_path, result.size_bytes,
             result.ratio_to_fp32, result.operators.describe())
    return result
