"""Ditto's two updates against Algorithm 1 and Eq. (2) of the paper written out here: the global
model is FedAvg's, the personal model descends F_k(v) + lambda/2 ||v - w^t||^2 anchored at the
global model that came down, and only the global model goes up.

One epoch over a batch that holds the whole training split is one step of SGD; the first step of
momentum SGD is a plain gradient step, so the personal model after it is v - lr * gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builtin_tasks import digits_client
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.ditto import PERSONAL_MODEL, DittoDevice
from edge_sdk.algorithms.fedavg import FedAvgDevice
from edge_sdk.algorithms.hyper.ditto import Hyper
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.settings import TrainSettings
from objectives import cross_entropy, snapshot

LR, LAM, TRAIN = 0.05, 0.7, 64
ONE_STEP = TrainSettings(model="cnn8", rounds=2, local_epochs=1, batch_size=TRAIN, lr=LR, seed=0)
"""One epoch is one full-batch step."""


pytestmark = pytest.mark.usefixtures("one_thread")


def make_device(cls=DittoDevice, **hyper) -> DittoDevice:
    data = digits_client(2, num_clients=10, partition="dirichlet", seed=0)
    data.train_x, data.train_y = data.train_x[:TRAIN], data.train_y[:TRAIN]
    chosen = Hyper(**{"lam": LAM, **hyper}) if cls is DittoDevice else cls.Hyper()
    return cls(chosen, ONE_STEP, data, "cpu", client_seed=7)


def global_task(device: DittoDevice, round_: int = 1) -> Task:
    """A round whose global model w^t is the device's initial model moved by seeded noise, so that
    v (still the initial model) and w^t differ."""
    rng = np.random.default_rng(round_)
    arrays = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in device.shared_state().items()}
    return Task(round_, {SHARED: arrays}, {})


def gradient_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                  anchor: dict[str, torch.Tensor], lam: float) -> dict[str, torch.Tensor]:
    """v - lr * (grad F_k(v) + lam * (v - w^t)) for every parameter of `model` (training mode)."""
    model.train()
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(cross_entropy(model(x), y), list(params.values()))
    return {name: (p - LR * (g + lam * (p - anchor[name]))).detach()
            for (name, p), g in zip(params.items(), grads, strict=True)}


def test_the_personal_update_is_a_step_on_h_k_anchored_at_the_global_model_that_came_down() -> None:
    # Prepare
    device = make_device()
    task = global_task(device)
    x, y = torch.from_numpy(device.data.train_x), torch.from_numpy(device.data.train_y)
    v_before = make_device().personal
    w_t = make_device()
    w_t.load_shared(task)
    expected = gradient_step(v_before, x, y, dict(w_t.model.named_parameters()), LAM)

    # Execute
    device.fit(task)

    # Assert: the anchor is w^t, not the device's updated w (which differs from it)
    for name, value in device.personal.named_parameters():
        torch.testing.assert_close(value.detach(), expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(dict(device.model.named_parameters())["head.weight"],
                           dict(w_t.model.named_parameters())["head.weight"])


def test_lambda_pulls_the_personal_model_towards_the_global_model() -> None:
    # Prepare
    near, free = make_device(lam=LAM), make_device(lam=0.0)
    task = global_task(near)
    w_t = make_device()
    w_t.load_shared(task)

    # Execute
    near.fit(task)
    free.fit(task)

    # Assert
    def distance(device: DittoDevice) -> float:
        anchor = dict(w_t.model.named_parameters())
        return sum(float(((p.detach() - anchor[n].detach()) ** 2).sum()) for n, p in device.personal.named_parameters())

    assert distance(near) < distance(free)


def test_the_global_update_and_the_upload_are_fedavgs_and_carry_nothing_of_the_personal_model() -> None:
    # Prepare
    ditto, fedavg = make_device(), make_device(FedAvgDevice)
    task = global_task(ditto)

    # Execute
    sent, reference = ditto.fit(task), fedavg.fit(task)

    # Assert
    assert set(sent.groups) == {SHARED}
    assert sent.groups[SHARED].keys() == reference.groups[SHARED].keys()
    for key, value in reference.groups[SHARED].items():
        np.testing.assert_array_equal(sent.groups[SHARED][key], value, err_msg=key)
    personal = {k.removeprefix(PERSONAL_MODEL): v for k, v in ditto.personal_state().items()
                if k.startswith(PERSONAL_MODEL)}
    assert not any(np.array_equal(personal[k], v) for k, v in sent.groups[SHARED].items() if v.size > 1)


def test_the_deployed_model_is_the_personal_one_and_a_restart_keeps_it() -> None:
    # Prepare
    device = make_device()
    task = global_task(device)
    device.fit(task)
    restarted = make_device()

    # Execute
    restarted.load_personal_state(device.personal_state())
    metrics = restarted.evaluate(global_task(device, round_=2))

    # Assert
    assert metrics["accuracy"] == device.test_accuracy(device.personal)
    assert metrics["global_accuracy"] == restarted.test_accuracy(restarted.model)
    saved = snapshot(device.personal)
    assert all(torch.equal(saved[k], v) for k, v in snapshot(restarted.personal).items())


def test_a_new_client_is_scored_after_one_personal_update_from_the_global_model() -> None:
    # Prepare: at v = w^t the proximal gradient is zero, so the step is w^t - lr * grad F_k(w^t)
    device = make_device()
    task = global_task(device)
    w_t = make_device()
    w_t.load_shared(task)
    x, y = torch.from_numpy(device.data.train_x), torch.from_numpy(device.data.train_y)
    anchor = {n: p.detach().clone() for n, p in w_t.model.named_parameters()}
    expected = gradient_step(w_t.model, x, y, anchor, LAM)

    # Execute
    device.evaluate(task)

    # Assert
    for name, value in device.personal.named_parameters():
        torch.testing.assert_close(value.detach(), expected[name], rtol=1e-5, atol=1e-6, msg=name)
