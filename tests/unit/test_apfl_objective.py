"""APFL's local step against Algorithm 1 and the adaptive alpha update (Eq. 10) of the paper written
out here: w takes FedAvg's step, v the step of F_k at the mixture v_bar = alpha v + (1 - alpha) w
(alpha times its gradient), alpha the step <v - w, grad F_k(v_bar)> projected onto [0, 1]; only w
goes up, and the deployed model is v_bar with the global model that came down.

One epoch over a batch that holds the whole training split is one step of SGD; the first step of
momentum SGD is a plain gradient step.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from builtin_tasks import digits_client
from edge_sdk.algorithms.apfl import MIXING_WEIGHT, PERSONAL_MODEL, ApflDevice
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.fedavg import FedAvgDevice
from edge_sdk.algorithms.hyper.apfl import Hyper
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.settings import TrainSettings
from objectives import cross_entropy

LR, ALPHA, ALPHA_LR, TRAIN = 0.05, 0.4, 0.3, 64
ONE_STEP = TrainSettings(model="cnn8", rounds=2, local_epochs=1, batch_size=TRAIN, lr=LR, seed=0)
"""One epoch is one full-batch step."""


pytestmark = pytest.mark.usefixtures("one_thread")


def make_device(cls=ApflDevice, **hyper):
    data = digits_client(2, num_clients=10, partition="dirichlet", seed=0)
    data.train_x, data.train_y = data.train_x[:TRAIN], data.train_y[:TRAIN]
    chosen = Hyper(**{"alpha": ALPHA, "alpha_lr": ALPHA_LR, **hyper}) if cls is ApflDevice else cls.Hyper()
    return cls(chosen, ONE_STEP, data, "cpu", client_seed=7)


def noisy(arrays: dict[str, np.ndarray], seed: int, keys=None) -> dict[str, np.ndarray]:
    """`arrays` with seeded noise added to `keys` (default: all)."""
    rng = np.random.default_rng(seed)
    return {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) if keys is None or k in keys else v
            for k, v in arrays.items()}


def global_task(device: ApflDevice, round_: int = 1) -> Task:
    """A round whose global model w^t is the device's initial global model moved by seeded noise."""
    return Task(round_, {SHARED: noisy(device.shared_state(), round_)}, {})


def with_own_state(device: ApflDevice, alpha: float = ALPHA) -> ApflDevice:
    """`device` restarted with a local model v away from every global model and mixing weight `alpha`."""
    state = device.personal_state()
    parameters = {PERSONAL_MODEL + name for name, _ in device.personal.named_parameters()}
    state = noisy(state, 99, parameters)
    state[MIXING_WEIGHT] = np.array(alpha, dtype=np.float32)
    device.load_personal_state(state)
    return device


def alpha_of(device: ApflDevice) -> float:
    return float(device.mixed.alpha.detach())


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def mixture(v: torch.nn.Module, w: dict[str, torch.Tensor], alpha: float) -> torch.nn.Module:
    """A copy of v's network (its buffers too) whose parameters are alpha v + (1 - alpha) w."""
    mixed = copy.deepcopy(v)
    with torch.no_grad():
        for name, p in mixed.named_parameters():
            p.copy_(alpha * p + (1 - alpha) * w[name])
    return mixed


def gradient(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """grad F_k of every parameter of `model`, in training mode."""
    model.train()
    named = dict(model.named_parameters())
    return dict(zip(named, torch.autograd.grad(cross_entropy(model(x), y), list(named.values())), strict=True))


def expected_step(device: ApflDevice, task: Task, alpha_lr: float) -> tuple[dict, dict, float]:
    """(w', v', alpha') of Algorithm 1 from the device's v and alpha and the w^t in `task`, by hand."""
    x, y = torch.from_numpy(device.data.train_x), torch.from_numpy(device.data.train_y)
    w_model = copy.deepcopy(device.model)
    received = {k: torch.from_numpy(v) for k, v in task.groups[SHARED].items()}
    w_model.load_state_dict({**w_model.state_dict(), **received})
    w, v, alpha = params(w_model), params(device.personal), alpha_of(device)
    grad_w = gradient(w_model, x, y)
    grad_bar = gradient(mixture(device.personal, w, alpha), x, y)
    w_next = {n: w[n] - LR * grad_w[n] for n in w}
    v_next = {n: v[n] - LR * alpha * grad_bar[n] for n in v}
    alpha_gradient = sum(float(((v[n] - w[n]) * grad_bar[n]).sum()) for n in v)
    return w_next, v_next, min(1.0, max(0.0, alpha - alpha_lr * alpha_gradient))


def assert_params(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, value in module.named_parameters():
        torch.testing.assert_close(value.detach(), expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("alpha_lr", [ALPHA_LR, 1e6])
def test_one_local_step_is_algorithm_1_with_the_adaptive_alpha_projected_onto_0_1(alpha_lr: float) -> None:
    # Prepare
    device = with_own_state(make_device(alpha_lr=alpha_lr))
    task = global_task(device)
    w_next, v_next, alpha_next = expected_step(device, task, alpha_lr)

    # Execute
    device.fit(task)

    # Assert
    assert_params(device.model, w_next)
    assert_params(device.personal, v_next)
    assert alpha_of(device) == pytest.approx(alpha_next, rel=1e-4, abs=1e-6)
    if alpha_lr > 1:
        assert alpha_next in (0.0, 1.0)  # the step overshoots: the projection is what holds alpha
    else:
        assert 0 < alpha_next < 1 and alpha_next != pytest.approx(ALPHA, abs=1e-4)


def test_a_fixed_alpha_stays_and_still_scales_the_local_models_step() -> None:
    # Prepare
    device = with_own_state(make_device(adaptive=False))
    task = global_task(device)
    _, v_next, _ = expected_step(device, task, 0.0)

    # Execute
    device.fit(task)

    # Assert
    assert alpha_of(device) == np.float32(ALPHA)
    assert_params(device.personal, v_next)


def test_the_upload_is_fedavgs_and_carries_neither_the_local_model_nor_alpha() -> None:
    # Prepare
    apfl, fedavg = with_own_state(make_device()), make_device(FedAvgDevice)
    task = global_task(apfl)

    # Execute
    sent, reference = apfl.fit(task), fedavg.fit(task)

    # Assert
    assert set(sent.groups) == {SHARED}
    assert sent.groups[SHARED].keys() == reference.groups[SHARED].keys()
    for key, value in reference.groups[SHARED].items():
        np.testing.assert_array_equal(sent.groups[SHARED][key], value, err_msg=key)
    assert set(sent.metrics) == {"num_examples", "loss"}
    personal = {k.removeprefix(PERSONAL_MODEL): v for k, v in apfl.personal_state().items()
                if k.startswith(PERSONAL_MODEL)}
    assert not any(np.array_equal(personal[k], v) for k, v in sent.groups[SHARED].items() if v.size > 1)


def test_the_deployed_model_is_the_mixture_with_the_global_model_that_came_down_and_a_restart_keeps_it() -> None:
    # Prepare
    device = with_own_state(make_device())
    device.fit(global_task(device))
    restarted = make_device()
    restarted.load_personal_state(device.personal_state())
    task = global_task(device, round_=2)
    w_t = make_device()
    w_t.load_shared(task)
    expected = mixture(device.personal, params(w_t.model), alpha_of(device))

    # Execute
    metrics = restarted.evaluate(task)

    # Assert
    assert alpha_of(restarted) == alpha_of(device) != np.float32(ALPHA)
    assert metrics["accuracy"] == restarted.test_accuracy(expected)
    assert metrics["global_accuracy"] == restarted.test_accuracy(restarted.model)
    assert metrics["accuracy"] != metrics["global_accuracy"]


def test_a_new_client_starts_its_local_model_at_the_global_model_that_came_down() -> None:
    # Prepare
    device = make_device()
    task = global_task(device)
    w_t = make_device()
    w_t.load_shared(task)

    # Execute
    metrics = device.evaluate(task)

    # Assert: v = w^t, so the deployed mixture is the global model
    assert_params(device.personal, params(w_t.model))
    assert alpha_of(device) == np.float32(ALPHA)
    assert metrics["accuracy"] == metrics["global_accuracy"]
