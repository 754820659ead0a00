"""DualFed's stage (a) objective against Eq. (6)-(8) written out here, and what each stage may change.

lambda is 0.6 (not the default 1), so that a loss that drops or ignores it shows; the two
augmented views come from the same seeded generator as the algorithm's. The network is in
evaluation mode, so that BatchNorm treats every view on its own and the reference may pass the
views through it one at a time.
"""

from __future__ import annotations

import torch

from builtin_tasks import digits_client
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.dualfed import DualFedDevice, Hyper
from edge_sdk.augment import task_views
from edge_sdk.settings import TrainSettings
from objectives import assert_same_objective, changed, cross_entropy, snapshot, supcon, tiny_batch

LAM, TEMPERATURE, VIEW_SEED = 0.6, 0.2, 5
SETTINGS = TrainSettings(model="cnn8", rounds=3, local_epochs=1, batch_size=32, lr=0.05, seed=0)


def make_device() -> DualFedDevice:
    data = digits_client(2, num_clients=10, partition="dirichlet", seed=0)
    return DualFedDevice(Hyper(lam=LAM, temperature=TEMPERATURE), SETTINGS, data, "cpu", client_seed=102)


def reference_loss(device: DualFedDevice, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Eq. (8): CE(head(u)) over both views + lambda * SupCon_out(u), u = projector(body(view))."""
    model = device.model
    views = task_views(x, device.data.task, torch.Generator().manual_seed(VIEW_SEED))  # [B, 2, ...]
    u = torch.stack([model.projector(model.body(views[:, v])) for v in range(2)], dim=1)  # [B, 2, d]
    labels = torch.stack([y, y], dim=1)
    ce = cross_entropy(model.head(u.reshape(2 * len(y), -1)), labels.reshape(-1))
    return ce + LAM * supcon(u, y, TEMPERATURE, "out")


def test_stage_a_loss_is_eq_8_in_value_and_gradient() -> None:
    # Prepare
    device = make_device()
    device.model.eval()
    x, y = tiny_batch(device.data)
    loss = device.main_branch_loss(torch.Generator().manual_seed(VIEW_SEED))

    # Execute / Assert: the same value and gradient for every parameter; none for global_head
    assert_same_objective(lambda: loss(x, y), lambda: reference_loss(device, x, y),
                          dict(device.model.named_parameters()))


def test_stage_a_loss_has_no_gradient_on_the_global_head() -> None:
    # Prepare
    device = make_device()
    device.model.train()
    x, y = tiny_batch(device.data)

    # Execute
    device.main_branch_loss(torch.Generator().manual_seed(VIEW_SEED))(x, y).backward()

    # Assert
    assert all(p.grad is None for p in device.model.global_head.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in device.model.projector.parameters())


def test_the_contrastive_term_is_on_the_projected_features() -> None:
    # Prepare
    device = make_device()
    device.model.eval()
    x, y = tiny_batch(device.data)

    # Execute
    with torch.no_grad():
        total = float(device.main_branch_loss(torch.Generator().manual_seed(VIEW_SEED))(x, y))
        views = task_views(x, device.data.task, torch.Generator().manual_seed(VIEW_SEED))
        u = torch.stack([device.model.projector(device.model.body(views[:, v])) for v in range(2)], dim=1)
        z = torch.stack([device.model.body(views[:, v]) for v in range(2)], dim=1)
        ce = cross_entropy(device.model.head(u.reshape(2 * len(y), -1)), torch.stack([y, y], 1).reshape(-1))

    # Assert: what lambda weighs is SupCon of u, not of z
    torch.testing.assert_close(torch.tensor((total - float(ce)) / LAM), supcon(u, y, TEMPERATURE), rtol=1e-4, atol=1e-5)
    assert abs(float(supcon(z, y, TEMPERATURE)) - float(supcon(u, y, TEMPERATURE))) > 1e-3


def test_fit_changes_the_main_branch_and_the_global_head_and_stage_b_alone_only_the_global_head() -> None:
    # Prepare
    device = make_device()
    before = snapshot(device.model)

    # Execute: stage (b) alone, then a whole local round on a fresh device
    device.train_global_head(torch.Generator().manual_seed(1))
    whole = make_device()
    whole.fit(Task(1, {}, {}))

    # Assert
    assert changed(before, device.model, "global_head.")
    for part in ("body.", "projector.", "head."):
        assert not changed(before, device.model, part), part
    for part in ("body.", "projector.", "head.", "global_head."):
        assert changed(before, whole.model, part), part
