"""Compose a released body with a torch head into one personalized ONNX model.

Weak devices compose their numpy heads (dense layers, nearest class mean) with
`edge_sdk.lite.compose` (re-exported here as `compose`); a trainer device that fitted a torch
head (RepPer's `linear` or `mlp`) uses `compose_torch_head`: the head is exported to ONNX on
its own (input `features`, output its logits), `label` = ArgMax and `probabilities` = Softmax of
the logits are appended, and the result is merged with the body like any other head.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from edge_sdk.lite.compose import FEATURES, ComposeError, compose, scores_to_classifier

from .onnx_export import torch_to_onnx

__all__ = ["compose", "compose_torch_head", "torch_head_to_onnx"]

_LOGITS = "logits"


def _default_opset(model: onnx.ModelProto) -> int:
    return max(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))


def _feature_dim(body: onnx.ModelProto) -> int:
    """The static width of the body's `features` output."""
    for value in body.graph.output:
        if value.name == FEATURES:
            dims = value.type.tensor_type.shape.dim
            if len(dims) == 2 and dims[1].HasField("dim_value"):
                return dims[1].dim_value
    raise ComposeError(f"the body has no {FEATURES!r} output of static shape [batch, d]")


def torch_head_to_onnx(head: nn.Module, feature_dim: int, num_classes: int, *, opset: int = 17) -> onnx.ModelProto:
    """A torch head mapping features [N, feature_dim] to logits [N, num_classes] as a head model
    with outputs `label` (argmax) and `probabilities` (softmax)."""
    module = copy.deepcopy(head).cpu().eval()
    example = torch.zeros(2, feature_dim)
    with torch.no_grad():
        width = module(example).shape
    if tuple(width) != (2, num_classes):
        raise ComposeError(f"the head maps [N, {feature_dim}] to {list(width[1:])}, not [{num_classes}] logits")
    model = torch_to_onnx(module, example, input_name=FEATURES, output_name=_LOGITS, opset=opset)
    return scores_to_classifier(model, scores=_LOGITS, classes=np.arange(num_classes), num_classes=num_classes)


def compose_torch_head(
    body_path: str | Path,
    head: nn.Module,
    out_path: str | Path,
    *,
    num_classes: int,
    metadata: Mapping[str, Any],
) -> Path:
    """Write the body at `body_path` followed by the torch `head` (features -> logits) to
    `out_path` as one model with outputs `label` and `probabilities`; `head` in the metadata is
    "torch" unless `metadata` names it."""
    body = onnx.load(str(body_path))
    head_model = torch_head_to_onnx(head, _feature_dim(body), num_classes, opset=_default_opset(body))
    return compose(body, head_model, out_path, num_classes=num_classes, metadata={"head": "torch", **metadata})
