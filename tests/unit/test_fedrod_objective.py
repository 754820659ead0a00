"""FedRoD's local objective against the paper's two losses written out here: the body and the
generic head descend the balanced softmax, cross-entropy of head(z) + log(n_c / n) with the
device's class counts n_c; the personal head descends cross-entropy of head(z) + personal_head(z)
with nothing of it reaching the body or the generic head. Only the body and the generic head go
up; the deployed prediction adds the two heads' logits.

One epoch over a batch that holds the whole training split is one step of SGD; the first step of
momentum SGD is a plain gradient step.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from builtin_tasks import digits_client
from coordinator.algorithms import load as load_server
from coordinator.algorithms.base import ServerContext
from edge_sdk import training
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.fedrod import FedRodDevice
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.settings import TrainSettings
from objectives import assert_same_objective, cross_entropy, value_and_gradients

LR, TRAIN = 0.05, 64
ONE_STEP = TrainSettings(model="cnn8", rounds=2, local_epochs=1, batch_size=TRAIN, lr=LR, seed=0)
"""One epoch is one full-batch step."""


pytestmark = pytest.mark.usefixtures("one_thread")


def make_device() -> FedRodDevice:
    data = digits_client(2, num_clients=10, partition="dirichlet", seed=0)
    data.train_x, data.train_y = data.train_x[:TRAIN], data.train_y[:TRAIN]
    return FedRodDevice(FedRodDevice.Hyper(), ONE_STEP, data, "cpu", client_seed=7)


def trained_personal_head(device: FedRodDevice) -> FedRodDevice:
    """`device` restarted with a personal head away from zero (seeded noise)."""
    rng = np.random.default_rng(5)
    state = {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(v.dtype) if k.startswith("personal_head.") else v
             for k, v in device.personal_state().items()}
    device.load_personal_state(state)
    return device


def paper_objective(device: FedRodDevice, x: torch.Tensor, y: torch.Tensor):
    """The two losses, the prior counted label by label from the device's training split."""
    counts, classes = Counter(int(label) for label in device.data.train_y), device.data.task.num_classes
    total = sum(counts.values())
    prior = torch.tensor([math.log(counts[c] / total) if counts[c] else -math.inf for c in range(classes)])
    model = device.model

    def loss() -> torch.Tensor:
        generic = model.head(model.body(x))
        with torch.no_grad():  # the personal loss sees the features and generic logits as constants
            z, fixed = model.body(x), model.head(model.body(x))
        return cross_entropy(generic + prior, y) + cross_entropy(fixed + model.personal_head(z), y)

    return loss


def full_batch(device: FedRodDevice) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(device.data.train_x), torch.from_numpy(device.data.train_y)


def test_the_local_loss_is_the_balanced_softmax_plus_the_personal_heads_cross_entropy() -> None:
    # Prepare: a device whose labels miss some classes and are not balanced
    device = trained_personal_head(make_device())
    x, y = full_batch(device)
    counts = np.bincount(device.data.train_y, minlength=device.data.task.num_classes)
    assert (counts == 0).any() and len(set(counts[counts > 0])) > 1
    device.model.train()

    # Execute / Assert
    assert_same_objective(lambda: device.local_loss(Task(1, {}, {}))(x, y), paper_objective(device, x, y),
                          dict(device.model.named_parameters()))


def test_one_local_step_descends_each_parts_own_loss() -> None:
    # Prepare
    device = trained_personal_head(make_device())
    x, y = full_batch(device)
    before = {n: p.detach().clone() for n, p in device.model.named_parameters()}
    device.model.train()
    _, grads = value_and_gradients(paper_objective(device, x, y), dict(device.model.named_parameters()))
    task = Task(1, {SHARED: device.shared_state()}, {})

    # Execute
    device.fit(task)

    # Assert
    for name, value in device.model.named_parameters():
        torch.testing.assert_close(value.detach(), before[name] - LR * grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_only_the_body_and_the_generic_head_go_up_and_the_coordinator_starts_from_the_devices_model() -> None:
    # Prepare
    device = make_device()
    server_cls = load_server("fedrod")
    server = server_cls(server_cls.Hyper(), ServerContext("cnn8", device.data.task, seed=0, rounds=2, clients=1))

    # Execute
    sent = device.fit(Task(1, server.eval_groups(), {}))

    # Assert
    initial = server.initial_state()[SHARED]
    assert set(initial) == set(sent.groups[SHARED]) == set(device.shared_state())
    assert all(k.split(".")[0] in ("body", "head") for k in initial)
    assert any(k.startswith("personal_head.") for k in device.personal_state())
    fresh = make_device().shared_state()
    for key, value in initial.items():
        np.testing.assert_array_equal(fresh[key], value, err_msg=key)


def test_the_deployed_prediction_adds_the_personal_heads_logits_and_a_restart_keeps_the_head() -> None:
    # Prepare
    device = trained_personal_head(make_device())
    device.fit(Task(1, {SHARED: device.shared_state()}, {}))
    restarted = make_device()
    restarted.load_personal_state(device.personal_state())
    task = Task(2, {SHARED: device.shared_state()}, {})

    # Execute
    metrics = restarted.evaluate(task)

    # Assert
    model, x, y = restarted.model, restarted.test_x, restarted.test_y
    with training.eval_mode(model), torch.no_grad():
        z = model.body(x)
        personalized = float(((model.head(z) + model.personal_head(z)).argmax(1) == y).float().mean())
        generic = float((model.head(z).argmax(1) == y).float().mean())
    assert (metrics["accuracy"], metrics["global_accuracy"]) == (personalized, generic)
    assert metrics["accuracy"] != metrics["global_accuracy"]
    torch.testing.assert_close(restarted.model.personal_head.weight, device.model.personal_head.weight)


def test_a_new_device_predicts_with_the_generic_head_alone() -> None:
    # Prepare
    device = make_device()

    # Execute
    metrics = device.evaluate(Task(1, {SHARED: device.shared_state()}, {}))

    # Assert
    assert not device.model.personal_head.weight.any() and not device.model.personal_head.bias.any()
    assert metrics["accuracy"] == metrics["global_accuracy"]
