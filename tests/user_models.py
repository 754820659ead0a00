"""Model factories as a user would write them, outside the registry: the tests name them by
import path (`user_models:tiny_mlp`) and through a fake distribution's entry point."""

from __future__ import annotations

import math

from torch import nn

from edge_sdk.data.task import TaskSpec
from edge_sdk.models import split


def tiny_mlp(task: TaskSpec) -> nn.Module:
    """A hand-written nn.Sequential MLP on flattened inputs; its last layer is the head."""
    return split(nn.Sequential(nn.Flatten(), nn.Linear(math.prod(task.input_shape), 32), nn.ReLU(),
                               nn.Linear(32, task.num_classes)), head="3")


def tiny_cnn(task: TaskSpec) -> nn.Module:
    """A small CNN for images of any H x W (adaptive pooling); its last layer is the head."""
    return split(nn.Sequential(nn.Conv2d(task.channels, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                               nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                               nn.Linear(64, task.num_classes)), head="7")


class AttentionNet(nn.Module):
    """A model with `body` and `head` children whose body holds a MultiheadAttention layer."""

    def __init__(self, task: TaskSpec) -> None:
        super().__init__()
        dim = task.input_shape[0]
        self.body = AttentionBody(dim)
        self.head = nn.Linear(dim, task.num_classes)

    def forward(self, x):
        return self.head(self.body(x))


class AttentionBody(nn.Module):
    """Self-attention over a feature vector seen as a sequence of one token."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, num_heads=1, batch_first=True)

    def forward(self, x):
        tokens = x.unsqueeze(1)
        return self.attention(tokens, tokens, tokens)[0].squeeze(1)


NOT_A_FACTORY = 42
