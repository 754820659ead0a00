"""RepPer's stage-1 objective against Eq. (4)-(5) (and Khosla et al.'s L_out) written out here, and
what each stage may change.

The network is in evaluation mode for the comparison, so that BatchNorm treats every view on its
own and the reference may pass the two views through the body one at a time.
"""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from builtin_tasks import digits_client
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.repper import Hyper, RepPerDevice
from edge_sdk.augment import task_views
from edge_sdk.settings import TrainSettings
from objectives import assert_same_objective, changed, snapshot, supcon, tiny_batch

TEMPERATURE, VIEW_SEED = 0.2, 9
Variant = Literal["in", "out"]
SETTINGS = TrainSettings(model="cnn8", rounds=3, local_epochs=1, batch_size=32, lr=0.05, seed=0)


def make_device(variant: Variant = "out") -> RepPerDevice:
    data = digits_client(3, num_clients=10, partition="iid", seed=0)
    return RepPerDevice(Hyper(variant=variant, temperature=TEMPERATURE), SETTINGS, data, "cpu", client_seed=103)


def reference_loss(device: RepPerDevice, x: torch.Tensor, y: torch.Tensor, variant: Variant) -> torch.Tensor:
    """Eq. (4)-(5): SupCon over the two views' body features, positives = same label."""
    views = task_views(x, device.data.task, torch.Generator().manual_seed(VIEW_SEED))  # [B, 2, ...]
    r = torch.stack([device.model.body(views[:, v]) for v in range(2)], dim=1)
    return supcon(r, y, TEMPERATURE, variant)


@pytest.mark.parametrize("variant", ["out", "in"])
def test_stage_one_loss_is_supcon_of_two_views_in_value_and_gradient(variant: Variant) -> None:
    # Prepare: a batch with repeated labels and more than one class (positives beyond the other view)
    device = make_device(variant)
    device.model.eval()
    x, y = tiny_batch(device.data, 8)
    assert 1 < len(set(y.tolist())) < len(y)
    loss = device.contrastive_loss(torch.Generator().manual_seed(VIEW_SEED))

    # Execute / Assert
    assert_same_objective(lambda: loss(x, y), lambda: reference_loss(device, x, y, variant),
                          dict(device.model.named_parameters()))


def make_loss(device: RepPerDevice, variant: Variant):
    """The device's stage-1 loss with `variant`, on the views of `VIEW_SEED`."""
    device.hyper = Hyper(variant=variant, temperature=TEMPERATURE)
    return device.contrastive_loss(torch.Generator().manual_seed(VIEW_SEED))


def test_the_variants_give_different_losses_on_the_same_batch() -> None:
    # Prepare
    device = make_device("in")
    device.model.eval()
    x, y = tiny_batch(device.data, 8)

    # Execute
    with torch.no_grad():
        values = {variant: float(make_loss(device, variant)(x, y)) for variant in ("in", "out")}

    # Assert: the configured variant is the one computed
    assert values["in"] == pytest.approx(float(reference_loss(device, x, y, "in").detach()), rel=1e-5)
    assert abs(values["in"] - values["out"]) > 1e-4


def test_stage_one_changes_the_body_and_stage_two_never_its_weights() -> None:
    # Prepare
    device = make_device()
    before = snapshot(device.model)

    # Execute: stage 2 (evaluation: a head on the frozen body), then stage 1
    device.evaluate(Task(1, {}, {}))
    after_evaluation = {k: v for k, v in snapshot(device.model).items() if "running" not in k and "batches" not in k}
    device.fit(Task(1, {}, {}))

    # Assert
    for key, value in after_evaluation.items():
        assert torch.equal(value, before[key]), key
    assert changed(before, device.model, "body.")
