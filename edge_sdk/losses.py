"""Losses shared by several algorithms.

`supcon_loss` is the supervised contrastive loss of Khosla et al. (2020). `variant="out"` is
their Eq. 2 (the average over positives outside the log; DualFed's Eq. 7); `variant="in"`
puts the average inside the log (RepPer's Eq. 5). No extra scale factor is applied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def supcon_loss(features: torch.Tensor, labels: torch.Tensor, temperature: float = 0.1,
                variant: str = "out") -> torch.Tensor:
    """Mean loss over the anchors (every view of every example) that have at least one positive.

    `features` is [batch, views, dim] (L2-normalized here), `labels` is [batch]. Positives of an
    anchor are the other views whose example has the same label; the denominator runs over every
    other view.
    """
    if features.dim() != 3:
        raise ValueError(f"features must be [batch, views, dim], got shape {tuple(features.shape)}")
    if variant not in ("out", "in"):
        raise ValueError(f"variant must be 'out' or 'in', got {variant!r}")
    batch, views, dim = features.shape
    z = F.normalize(features.reshape(batch * views, dim), dim=1)
    y = labels.repeat_interleave(views)
    self_mask = torch.eye(batch * views, dtype=torch.bool, device=z.device)
    logits = (z @ z.T / temperature).masked_fill(self_mask, float("-inf"))
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    positives = (y[:, None] == y[None, :]) & ~self_mask
    counts = positives.sum(dim=1)
    anchors = counts > 0
    if not anchors.any():
        return features.sum() * 0.0
    if variant == "out":
        per_anchor = -log_prob.masked_fill(~positives, 0.0).sum(dim=1) / counts.clamp(min=1)
    else:
        pos_log_prob = log_prob.masked_fill(~positives, float("-inf"))
        per_anchor = -(torch.logsumexp(pos_log_prob, dim=1) - torch.log(counts.clamp(min=1).to(log_prob.dtype)))
    return per_anchor[anchors].mean()
