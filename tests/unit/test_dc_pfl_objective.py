"""DC-PFL's objectives against the paper's equations written out here: the device's Eq. (4), and
the server's round, Eq. (8)-(9) then the calibration of Eq. (12), and what the local round changes.

For the server round every class is held by one client only and all its features are equal, so
its pooled covariance is zero and the virtual features are exactly the class means: the
calibration is then plain full-batch gradient descent that the test can write out.
"""

from __future__ import annotations

import numpy as np
import torch

from builtin_tasks import DIGITS, digits_client
from coordinator.algorithms.base import ServerContext
from coordinator.algorithms.dc_pfl import DcPflServer
from coordinator.rounds.inprocess import FixedUpdate, play_round
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.dc_pfl import STATS, DcPflDevice, Hyper
from edge_sdk.algorithms.torch_device import SHARED
from edge_sdk.settings import TrainSettings
from objectives import assert_same_objective, changed, cross_entropy, snapshot, tiny_batch

LAM, SERVER_LR, EPOCHS, CLASSES, DIM = 0.3, 0.5, 3, 10, 128
SETTINGS = TrainSettings(model="cnn8", rounds=2, local_epochs=1, batch_size=32, lr=0.05, seed=0)


def make_device() -> DcPflDevice:
    data = digits_client(5, num_clients=10, partition="iid", seed=0)
    return DcPflDevice(Hyper(lam=LAM), SETTINGS, data, "cpu", client_seed=5)


def test_the_local_loss_is_eq_4_in_value_and_gradient() -> None:
    # Prepare: global means for the even classes only
    device = make_device()
    device.model.train()
    x, y = tiny_batch(device.data, 10)
    means = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(3))
    has_mean = torch.arange(CLASSES) % 2 == 0
    assert has_mean[y].any() and not has_mean[y].all()
    loss = device.local_loss((means, has_mean))

    def reference() -> torch.Tensor:
        z = device.model.body(x)
        logits = z @ device.model.head.weight.T + device.model.head.bias
        distances = [((z[i] - means[int(c)]) ** 2).sum() if has_mean[int(c)] else z[i].sum() * 0
                     for i, c in enumerate(y)]
        return cross_entropy(logits, y) + LAM * torch.stack(distances).mean()

    # Execute / Assert
    assert_same_objective(lambda: loss(x, y), reference, dict(device.model.named_parameters()))


def test_a_local_round_changes_the_body_and_the_head_and_uploads_statistics_only() -> None:
    # Prepare
    device = make_device()
    before = snapshot(device.model)

    # Execute
    result = device.fit(Task(1, {}, {}))

    # Assert
    assert changed(before, device.model, "body.") and changed(before, device.model, "head.")
    assert set(result.groups) == {STATS}


def stats_of(classes: dict[int, np.ndarray], count: int) -> dict[str, np.ndarray]:
    """A `full`-mode upload of `count` identical features per class: zero covariances."""
    counts, means = np.zeros(CLASSES, np.int64), np.zeros((CLASSES, DIM), np.float32)
    for c, mean in classes.items():
        counts[c], means[c] = count, mean
    return {"counts": counts, "means": means, "cov": np.zeros((CLASSES, DIM, DIM), np.float32)}


def reference_round(weight: torch.Tensor, bias: torch.Tensor, clients: list[dict[int, np.ndarray]],
                    virtual: dict[int, int], epochs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (8)-(9): one SGD step per client (in id order) on the CE of its class means; then
    Eq. (12): `epochs` full-batch steps on the CE of the virtual features (here the means)."""
    weight, bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()

    def step(features: torch.Tensor, labels: torch.Tensor) -> None:
        loss = cross_entropy(features @ weight.T + bias, labels)
        grad_w, grad_b = torch.autograd.grad(loss, [weight, bias])
        with torch.no_grad():
            weight.sub_(SERVER_LR * grad_w)
            bias.sub_(SERVER_LR * grad_b)

    for classes in clients:
        present = sorted(classes)
        step(torch.tensor(np.stack([classes[c] for c in present])), torch.tensor(present))
    all_classes = {c: m for classes in clients for c, m in classes.items()}
    features = torch.tensor(np.concatenate([np.repeat(all_classes[c][None], n, 0) for c, n in virtual.items()]))
    labels = torch.tensor([c for c, n in virtual.items() for _ in range(n)])
    for _ in range(epochs):
        step(features, labels)
    return weight.detach(), bias.detach()


def test_the_server_round_is_the_classifier_steps_then_the_calibration() -> None:
    # Prepare: dev000 holds classes 1 and 3, dev001 classes 0 and 2; 2 examples of each class
    # (small features, so that the cross-entropies do not saturate within the round)
    rng = np.random.default_rng(4)
    mean = lambda: (0.1 * rng.normal(size=DIM)).astype(np.float32)  # noqa: E731
    clients = [{1: mean(), 3: mean()}, {0: mean(), 2: mean()}]
    hyper = Hyper(server_lr=SERVER_LR, calibration_epochs=EPOCHS, virtual_features=8, calibration_batch_size=8)
    server = DcPflServer(hyper, ServerContext(model="cnn8", task=DIGITS, seed=0, rounds=2, clients=2))
    initial = server.state[SHARED]
    start = torch.tensor(initial["head.weight"]), torch.tensor(initial["head.bias"])
    virtual = {0: 2, 1: 2, 2: 2, 3: 2}
    expected_weight, expected_bias = reference_round(*start, clients, virtual, EPOCHS)
    uncalibrated_weight, _ = reference_round(*start, clients, virtual, 0)
    assert (expected_weight - uncalibrated_weight).abs().max() > 1e-3

    # Execute: replies arrive in the reverse of id order
    play_round(server, {"dev001": FixedUpdate({STATS: stats_of(clients[1], 2)}, 4),
                        "dev000": FixedUpdate({STATS: stats_of(clients[0], 2)}, 4)}, 1)

    # Assert
    torch.testing.assert_close(torch.tensor(server.state[SHARED]["head.weight"]), expected_weight, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(server.state[SHARED]["head.bias"]), expected_bias, rtol=1e-4, atol=1e-6)
