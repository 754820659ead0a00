"""Unit tests for model capabilities: an algorithm refuses, at start and on both sides, a model
that lacks what it needs, naming itself and the missing capability."""

from __future__ import annotations

import numpy as np
import pytest
from torch import nn

import user_models
from coordinator.algorithms import load as load_server
from coordinator.algorithms.base import ServerContext
from edge_sdk.settings import TrainSettings
from edge_sdk.algorithms import ALGORITHM_IDS
from edge_sdk.algorithms import load as load_device
from edge_sdk.data import ClientData
from edge_sdk.data.task import TaskSpec
from edge_sdk.models import ModelCapabilityError, build_model, check_capabilities, split

WINE = TaskSpec("wine", "features", (13,), 3, ("a", "b", "c"), (0.0,) * 13, (1.0,) * 13)
SETTINGS = TrainSettings(model="user_models:AttentionNet", rounds=2, local_epochs=1, batch_size=8, lr=0.05, seed=0)


def mlp_head_model(task: TaskSpec) -> nn.Module:
    """A linear body with a two-layer head."""
    return split(nn.Sequential(nn.Linear(task.input_shape[0], 16), nn.ReLU(),
                               nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, task.num_classes))), head="2")


def wine_data() -> ClientData:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 13)).astype(np.float32), np.arange(24, dtype=np.int64) % 3
    return ClientData(x[:16], y[:16], x[16:], y[16:], task=WINE)


def test_every_algorithm_declares_the_common_capabilities() -> None:
    for algorithm_id in ALGORITHM_IDS:
        names = {capability.name for capability in load_device(algorithm_id).requires}
        assert {"parts", "flat_features"} <= names, algorithm_id


def test_cd2_pfed_refuses_a_body_that_is_not_channel_structured() -> None:
    # Prepare
    model = build_model(user_models.AttentionNet, WINE)

    # Execute / Assert
    with pytest.raises(ModelCapabilityError, match="^cd2_pfed needs a body of channel-structured layers.*"
                                                   "body.attention is a MultiheadAttention$"):
        check_capabilities(load_device("cd2_pfed"), model)


@pytest.mark.parametrize("algorithm_id", ["dc_pfl", "cd2_pfed", "fedios"])
def test_algorithms_that_split_or_replace_the_head_refuse_a_head_that_is_not_linear(algorithm_id: str) -> None:
    with pytest.raises(ModelCapabilityError, match=f"^{algorithm_id} needs a single nn.Linear head.*a Sequential"):
        check_capabilities(load_device(algorithm_id), build_model(mlp_head_model, WINE))


@pytest.mark.parametrize("algorithm_id", ["fedavg", "fedrep", "repper", "dualfed", "local"])
def test_algorithms_that_keep_the_head_as_it_is_take_any_head(algorithm_id: str) -> None:
    check_capabilities(load_device(algorithm_id), build_model(mlp_head_model, WINE))


def test_the_device_refuses_at_construction() -> None:
    # Prepare
    device_cls = load_device("cd2_pfed")

    # Execute / Assert
    with pytest.raises(ModelCapabilityError, match="cd2_pfed needs .*MultiheadAttention"):
        device_cls(device_cls.Hyper(), SETTINGS, wine_data(), "cpu", 1)


def test_the_coordinator_refuses_at_start() -> None:
    # Prepare
    server_cls = load_server("dc_pfl")
    context = ServerContext(mlp_head_model, WINE, seed=0, rounds=2, clients=2)

    # Execute / Assert
    with pytest.raises(ModelCapabilityError, match="dc_pfl needs a single nn.Linear head"):
        server_cls(server_cls.Hyper(), context)
