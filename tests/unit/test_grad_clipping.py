"""Local gradient-norm clipping (`grad_clip_norm`): what one step may move, how the setting is checked,
and that adding it left the fingerprints of earlier runs (the benchmarks' run cache) alone."""

from __future__ import annotations

import contextlib

import pytest
import torch

from coordinator.config.run_config import RunConfig, build_config
from edge_sdk.config import ConfigError, from_mapping
from edge_sdk.settings import TrainSettings
from edge_sdk.training import gradient_clipping, run_epochs


def one_step_change(clip: float | None) -> float:
    """The L2 distance one plain SGD step (lr 0.1) moves a linear model whose gradient is huge."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    x, y = torch.full((8, 4), 1e3), torch.full((8,), -1e3)

    def loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return ((model(xb).squeeze(1) - yb) ** 2).mean()

    with gradient_clipping(clip) if clip is not None else contextlib.nullcontext():
        run_epochs(loss, torch.optim.SGD(model.parameters(), lr=0.1), x, y, epochs=1, batch_size=8,
                   generator=torch.Generator().manual_seed(0))
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    return float((after - before).norm())


def test_a_clipped_step_moves_the_weights_by_at_most_lr_times_the_norm_and_the_block_ends_it():
    assert one_step_change(0.5) == pytest.approx(0.1 * 0.5, rel=1e-4)  # the gradient's norm is far above 0.5
    assert one_step_change(None) > 1e5  # outside the block nothing is clipped
    assert one_step_change(1e12) > 1e5  # a norm above the gradient's leaves it as it is


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_bad_grad_clip_norm_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match="^grad_clip_norm must be zero"):
        build_config(None, {"grad_clip_norm": value}, {})
    welcome = {"model": "cnn8", "rounds": 1, "local_epochs": 1, "batch_size": 32, "lr": 0.05, "seed": 0,
               "grad_clip_norm": value}
    with pytest.raises(ConfigError, match="^settings: grad_clip_norm must be zero"):
        from_mapping(TrainSettings, welcome, where="settings")


def test_the_fingerprint_changes_with_clipping_and_not_without():
    base = RunConfig()
    # the fingerprints of these configs before grad_clip_norm existed: cached runs must keep theirs
    assert base.fingerprint() == "70de55c5bbe64c40"
    assert RunConfig.of(dataset="fmnist", lr=0.1, algorithm="fedrep", hyper={"momentum": 0.5}).fingerprint() == \
        "d6ca0ea1b48da1aa"
    assert base.replace(grad_clip_norm=1.0).fingerprint() != base.fingerprint()
