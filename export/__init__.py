"""From a trained run to files a weak device can use: ONNX export with a parity check, int8
quantization, and composing a frozen body with a personal head into one model.

`export_run(run_dir, out_path)` is the entry point (the `edgepfl export` command and the
coordinator's release phase call it); the pieces are importable for other uses. This package
needs the train install (torch); what weak devices run lives in `edge_sdk.lite`.
"""

from .compose import compose, compose_torch_head
from .onnx_export import ExportMismatchError, ExportResult, export_module
from .quantize import QuantizeResult, quantize_int8
from .run import Representation, RepresentationError, export_run, load_representation

__all__ = [
    "ExportMismatchError",
    "ExportResult",
    "QuantizeResult",
    "Representation",
    "RepresentationError",
    "compose",
    "compose_torch_head",
    "export_module",
    "export_run",
    "load_representation",
    "quantize_int8",
]
