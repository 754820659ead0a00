"""From a body held in memory to files a weak device can use: ONNX export with a parity check,
int8 quantization, and composing a frozen body with a personal head into one model.

`export_body(body, input_shape, out_path, metadata=...)` is the entry point: the coordinator's
release passes the body of the state it holds, the `edgepfl export` command (coordinator side)
the body it rebuilt from a checkpoint. Nothing here reads a checkpoint, builds a model from a
name or imports the coordinator. This package needs the train install (torch); what weak
devices run lives in `edge_sdk.lite`.
"""

from .body import check_options, export_body, feature_dim, fp32_path
from .compose import compose, compose_torch_head
from .onnx_export import ExportMismatchError, ExportResult, export_module
from .quantize import OperatorPrecision, QuantizeResult, operator_precision, quantize_int8

__all__ = [
    "ExportMismatchError",
    "ExportResult",
    "OperatorPrecision",
    "QuantizeResult",
    "check_options",
    "compose",
    "compose_torch_head",
    "export_body",
    "export_module",
    "feature_dim",
    "fp32_path",
    "operator_precision",
    "quantize_int8",
]
