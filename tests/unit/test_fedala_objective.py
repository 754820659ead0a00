"""FedALA's adaptive local aggregation against the paper's equations written out here: the initial
local model is theta_i + (theta^t - theta_i) ⊙ W on the top layers and theta^t below them, W steps
by eta * (theta^t - theta_i) ⊙ grad L(theta_hat) on the round's sample and is clipped into [0, 1];
the first aggregation iterates until its loss settles, later ones take one iteration; the upload
is FedAvg's trained from theta_hat, and the deployed model is ALA applied to the model that came
down.

One pass over a batch that holds the whole sample is one gradient step of W; one local epoch over a
batch that holds the whole training split is one SGD step.
"""

from __future__ import annotations

import copy
import statistics

import numpy as np
import pytest
import torch

from builtin_tasks import digits_client
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.fedala import ALA_STAGE, ALA_WEIGHTS, FRESH, LEARNED, LOCAL, FedAlaDevice
from edge_sdk.algorithms.fedavg import FedAvgDevice
from edge_sdk.algorithms.hyper.fedala import Hyper
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.settings import TrainSettings
from objectives import cross_entropy

LR, ETA, TRAIN = 0.05, 20.0, 64
ONE_STEP = TrainSettings(model="cnn8", rounds=3, local_epochs=1, batch_size=TRAIN, lr=LR, seed=0)
"""One epoch is one full-batch step; the sample fits one batch too."""


pytestmark = pytest.mark.usefixtures("one_thread")


def make_device(cls=FedAlaDevice, **hyper):
    data = digits_client(2, num_clients=10, partition="dirichlet", seed=0)
    data.train_x, data.train_y = data.train_x[:TRAIN], data.train_y[:TRAIN]
    chosen = Hyper(**{"eta": ETA, **hyper}) if cls is FedAlaDevice else cls.Hyper()
    return cls(chosen, ONE_STEP, data, "cpu", client_seed=7)


def noisy(arrays: dict[str, np.ndarray], seed: int, keys=None, scale: float = 0.05) -> dict[str, np.ndarray]:
    """`arrays` with seeded noise added to `keys` (default: all)."""
    rng = np.random.default_rng(seed)
    return {k: (v + scale * rng.standard_normal(v.shape)).astype(v.dtype) if keys is None or k in keys else v
            for k, v in arrays.items()}


def global_task(device: FedAlaDevice, round_: int = 1) -> Task:
    """A round whose global model theta^t is the factory's model moved by seeded noise."""
    return Task(round_, {SHARED: noisy(make_device().shared_state(), round_)}, {})


def with_own_state(device: FedAlaDevice, stage: int = LEARNED) -> FedAlaDevice:
    """`device` restarted with a local model theta_i far from every global model, weights W drawn in
    [0.2, 0.8] and the given stage."""
    state = device.personal_state()
    parameters = {name for name, _ in device.model.named_parameters()}
    state = noisy(state, 99, parameters, scale=0.3)
    rng = np.random.default_rng(5)
    for key in [k for k in state if k.startswith(ALA_WEIGHTS)]:
        state[key] = rng.uniform(0.2, 0.8, state[key].shape).astype(np.float32)
    state[ALA_STAGE] = np.array(stage, dtype=np.int8)
    device.load_personal_state(state)
    return device


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def weights_of(device: FedAlaDevice) -> dict[str, torch.Tensor]:
    return {k.removeprefix(ALA_WEIGHTS): torch.from_numpy(v) for k, v in device.personal_state().items()
            if k.startswith(ALA_WEIGHTS)}


def with_params(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of `module` (its buffers too) with the parameters `values` names replaced."""
    copied = copy.deepcopy(module)
    with torch.no_grad():
        for name, p in copied.named_parameters():
            if name in values:
                p.copy_(values[name])
    return copied


def expected_ala(device: FedAlaDevice, task: Task, eta: float) -> tuple[dict, dict]:
    """(theta_hat's parameters, W') of one ALA step from the device's theta_i and W and the theta^t in
    `task`, by hand, on the device's sample of the round."""
    rows = device.sample(task.round)
    x, y = torch.from_numpy(device.data.train_x)[rows], torch.from_numpy(device.data.train_y)[rows]
    theta_i, w = params(device.model), weights_of(device)
    received = {k: torch.from_numpy(v) for k, v in task.groups[SHARED].items()}
    top = {n: theta_i[n] + (received[n] - theta_i[n]) * w[n] for n in w}
    hat = with_params(device.model, {**received, **top})
    hat.train()
    named = dict(hat.named_parameters())
    grads = dict(zip(named, torch.autograd.grad(cross_entropy(hat(x), y), list(named.values())), strict=True))
    w_next = {n: (w[n] - eta * (received[n] - theta_i[n]) * grads[n]).clamp(0.0, 1.0) for n in w}
    top_next = {n: theta_i[n] + (received[n] - theta_i[n]) * w_next[n] for n in w}
    return {n: received[n] for n in named} | top_next, w_next


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in actual.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.clone() for name, b in module.named_buffers()}


def test_the_sample_is_a_random_share_of_the_training_split_drawn_anew_each_round() -> None:
    # Prepare
    device, whole = make_device(), make_device(sample_percent=100)

    # Execute
    first, second = device.sample(1), device.sample(2)

    # Assert
    assert len(first) == len(set(first.tolist())) == int(TRAIN * 0.8)
    assert set(first.tolist()) <= set(range(TRAIN)) and set(first.tolist()) != set(second.tolist())
    assert sorted(whole.sample(1).tolist()) == list(range(TRAIN))


@pytest.mark.parametrize("eta", [ETA, 1e6])
def test_one_aggregation_step_is_the_papers_with_lower_layers_from_the_global_model_and_w_clipped(eta) -> None:
    # Prepare
    device = with_own_state(make_device(eta=eta))
    task = global_task(device)
    expected, w_next = expected_ala(device, task, eta)
    w_before, statistics_before = weights_of(device), buffers(device.model)

    # Execute
    losses = device.initialize_local_model(task)

    # Assert
    assert len(losses) == 1
    assert_close(params(device.model), expected)
    assert_close(weights_of(device), w_next)
    assert set(w_next) == {"head.weight", "head.bias"}  # the default top layers: the linear head
    assert all(torch.equal(b, statistics_before[n]) for n, b in device.model.named_buffers())
    moved = torch.cat([(w_next[n] - w_before[n]).abs().flatten() for n in w_next])
    if eta > 1:  # the step overshoots: the clipping is what holds W
        flat = torch.cat([w.flatten() for w in w_next.values()])
        assert (flat == 0).any() and (flat == 1).any()
    else:
        assert float(moved.max()) > 1e-3


def test_the_top_layers_are_the_last_parameter_tensors() -> None:
    # Prepare
    device = with_own_state(make_device(layers=4))
    task = global_task(device)
    expected, w_next = expected_ala(device, task, ETA)

    # Execute
    device.initialize_local_model(task)

    # Assert
    names = [name for name, _ in device.model.named_parameters()]
    assert list(w_next) == names[-4:] and names[-4].startswith("body.")
    assert_close(params(device.model), expected)


def test_the_first_aggregation_iterates_until_the_loss_settles_and_later_ones_once() -> None:
    # Prepare
    settling, capped = with_own_state(make_device(eta=1.0), LOCAL), with_own_state(
        make_device(threshold=1e-12, window=3, max_iterations=7), LOCAL)
    loose = with_own_state(make_device(threshold=1e9, window=3), LOCAL)

    # Execute
    losses = settling.initialize_local_model(global_task(settling))
    at_cap = capped.initialize_local_model(global_task(capped))
    at_once = loose.initialize_local_model(global_task(loose))
    later = capped.initialize_local_model(global_task(capped, round_=2))

    # Assert: the first iteration whose last 10 losses spread by less than 0.1 ends it (at the paper's eta)
    window = Hyper().window
    settled = [k for k in range(window + 1, len(losses) + 1) if statistics.pstdev(losses[k - window:k]) < 0.1]
    assert settled == [len(losses)] and window + 1 < len(losses) < Hyper().max_iterations
    assert (len(at_cap), len(at_once), len(later)) == (7, 4, 1)
    assert settling.stage == capped.stage == LEARNED


def test_a_device_without_a_local_model_takes_the_global_model_and_uploads_fedavgs_update() -> None:
    # Prepare
    fedala, fedavg = make_device(), make_device(FedAvgDevice)
    task = global_task(fedala)

    # Execute
    sent, reference = fedala.fit(task), fedavg.fit(task)

    # Assert
    for key, value in reference.groups[SHARED].items():
        np.testing.assert_array_equal(sent.groups[SHARED][key], value, err_msg=key)
    assert all(torch.equal(w, torch.ones_like(w)) for w in weights_of(fedala).values())
    assert fedala.stage == LOCAL


def test_the_upload_is_fedavgs_trained_from_theta_hat_and_carries_nothing_personal() -> None:
    # Prepare
    fedala, fedavg = with_own_state(make_device()), make_device(FedAvgDevice)
    task = global_task(fedala)
    expected, _ = expected_ala(fedala, task, ETA)
    own = fedala.personal_state()
    fedavg.load_personal_state({k: own[k] for k in fedavg.personal_state()})  # theta_i's statistics
    from_hat = Task(task.round, {SHARED: {**task.groups[SHARED], **{k: v.numpy() for k, v in expected.items()}}}, {})

    # Execute
    sent, reference = fedala.fit(task), fedavg.fit(from_hat)

    # Assert
    assert set(sent.groups) == {SHARED} and set(sent.metrics) == {"num_examples", "loss"}
    assert sent.groups[SHARED].keys() == reference.groups[SHARED].keys()
    for key, value in reference.groups[SHARED].items():
        np.testing.assert_allclose(sent.groups[SHARED][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert not any(np.array_equal(sent.groups[SHARED][k], expected[k].numpy()) for k in expected)  # it trained


def test_a_restart_keeps_the_local_model_the_weights_and_the_stage() -> None:
    # Prepare
    device = make_device()
    device.fit(global_task(device, 1))
    device.fit(global_task(device, 2))
    restarted = make_device()

    # Execute
    restarted.load_personal_state(device.personal_state())
    sent, reference = restarted.fit(global_task(device, 3)), device.fit(global_task(device, 3))

    # Assert
    assert restarted.stage == LEARNED
    assert any(not torch.equal(w, torch.ones_like(w)) for w in weights_of(restarted).values())
    for key, value in reference.groups[SHARED].items():
        np.testing.assert_array_equal(sent.groups[SHARED][key], value, err_msg=key)
    for key, value in device.personal_state().items():
        np.testing.assert_array_equal(restarted.personal_state()[key], value, err_msg=key)


def test_the_deployed_model_is_ala_on_the_model_that_came_down_and_evaluation_changes_no_state() -> None:
    # Prepare
    device = with_own_state(make_device())
    task = global_task(device, round_=2)
    expected, _ = expected_ala(device, task, ETA)
    deployed = with_params(device.model, expected)
    received = with_params(device.model, {k: torch.from_numpy(v) for k, v in task.groups[SHARED].items()})
    before = device.personal_state()

    # Execute
    metrics = device.evaluate(task)

    # Assert
    assert metrics["accuracy"] == device.test_accuracy(deployed)
    assert metrics["global_accuracy"] == device.test_accuracy(received)
    assert metrics["accuracy"] != metrics["global_accuracy"]
    for key, value in device.personal_state().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


def test_a_new_client_deploys_the_global_model() -> None:
    # Prepare
    device = make_device()

    # Execute
    metrics = device.evaluate(global_task(device))

    # Assert
    assert metrics["accuracy"] == metrics["global_accuracy"]
    assert device.stage == FRESH


def test_the_global_bodys_statistics_for_a_release_leave_the_local_model_as_it_is() -> None:
    # Prepare
    fedala, fedavg = with_own_state(make_device(layers=4)), make_device(FedAvgDevice)
    own = fedala.personal_state()
    fedavg.load_personal_state({k: own[k] for k in fedavg.personal_state()})
    task = global_task(fedala)

    # Execute
    statistics_of_body, reference = fedala.body_statistics(task), fedavg.body_statistics(task)

    # Assert
    assert statistics_of_body.keys() == reference.keys() and reference
    for key, value in reference.items():
        np.testing.assert_array_equal(statistics_of_body[key], value, err_msg=key)
    for key, value in fedala.personal_state().items():
        np.testing.assert_array_equal(value, own[key], err_msg=key)
