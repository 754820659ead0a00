"""CD2-pFed's local objective against Eq. (3)-(5) written out here, and which sub-network is which.

Round 2 of 4 with p = 0.5: p_t = 0.25, so that each layer has both shared and personal channels.
The personal entries are written out by hand: the last round(p_t C) output channels of every
body tensor, the last input columns of the head's weight, none of the head's bias. L_CD comes in
three forms (the module's Decision): Eq. (4) (`cyclic`), the in-place distillation of the paper's
ref. 43 (`inplace`) and their sum (`cyclic+inplace`, the default).
"""

from __future__ import annotations

import math
from typing import Literal

import pytest
import torch
from torch.func import functional_call

from builtin_tasks import digits_client
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.cd2_pfed import CD2PFedDevice, Hyper
from edge_sdk.settings import TrainSettings
from objectives import assert_same_objective, cross_entropy, kl, prefixed, tiny_batch, value_and_gradients

ROUND, ROUNDS, P, LAM = 2, 4, 0.5, 0.8
Distillation = Literal["cyclic+inplace", "inplace", "cyclic"]


def make_device(distillation: Distillation = "cyclic+inplace") -> CD2PFedDevice:
    data = digits_client(4, num_clients=10, partition="dirichlet", seed=0)
    settings = TrainSettings("cnn8", ROUNDS, local_epochs=1, batch_size=32, lr=0.05, seed=0)
    return CD2PFedDevice(Hyper(p=P, lam=LAM, distillation=distillation), settings, data, "cpu", client_seed=14)


def personal_entries(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """True on the personal entries of parameter `name` at round ROUND."""
    fraction = P * ROUND / ROUNDS
    mask = torch.zeros(tensor.shape, dtype=torch.bool)
    if name == "head.bias":
        return mask
    axis = 1 if name == "head.weight" else 0
    personal = math.floor(fraction * tensor.shape[axis] + 0.5)
    if axis == 0:
        mask[tensor.shape[0] - personal:] = True
    else:
        mask[:, tensor.shape[1] - personal:] = True
    return mask


def sub_network(model: torch.nn.Module, x: torch.Tensor, keep_personal: bool,
                buffers: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits of g_wi (`keep_personal`) or g_w0: the other entries set to zero."""
    params = {}
    for name, param in model.named_parameters():
        mask = personal_entries(name, param)
        params[name] = param * (mask if keep_personal else ~mask)
    buffers = buffers if buffers is not None else {k: v.clone() for k, v in model.named_buffers()}
    return functional_call(model, {**params, **buffers}, (x,))


def reference_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, distillation: str) -> torch.Tensor:
    """Eq. (5): CE(g_{wi,w0}) + lambda L_CD, each KL's target detached; L_CD is
    cyclic: 1/2 (KL(p_L || p_G) + KL(p_G || p_L)) (Eq. 4),
    inplace: 1/2 (KL(p_F || p_G) + KL(p_F || p_L)) (ref. 43), cyclic+inplace: their sum."""
    full, local, shared = model(x), sub_network(model, x, True), sub_network(model, x, False)
    cyclic = 0.5 * (kl(local.detach(), shared) + kl(shared.detach(), local))
    inplace = 0.5 * (kl(full.detach(), shared) + kl(full.detach(), local))
    terms = {"cyclic": cyclic, "inplace": inplace, "cyclic+inplace": cyclic + inplace}
    return cross_entropy(full, y) + LAM * terms[distillation]


@pytest.mark.parametrize("distillation", ["cyclic+inplace", "inplace", "cyclic"])
def test_the_loss_is_eq_5_in_value_and_gradient(distillation: Distillation) -> None:
    # Prepare: evaluation mode, so that every pass uses the same (initial) BatchNorm statistics
    device = make_device(distillation)
    device.model.eval()
    x, y = tiny_batch(device.data)
    loss = device.local_loss(Task(ROUND, {}, {}))

    # Execute / Assert
    assert_same_objective(lambda: loss(x, y), lambda: reference_loss(device.model, x, y, distillation),
                          dict(device.model.named_parameters()))


def test_the_default_distillation_is_cyclic_plus_inplace() -> None:
    assert Hyper().distillation == "cyclic+inplace"


@pytest.mark.parametrize("distillation", ["cyclic+inplace", "inplace", "cyclic"])
def test_the_distillation_term_is_not_zero_on_the_batch(distillation: Distillation) -> None:
    # Prepare
    device = make_device(distillation)
    device.model.eval()
    x, y = tiny_batch(device.data)

    # Execute
    with torch.no_grad():
        total = float(device.local_loss(Task(ROUND, {}, {}))(x, y))
        ce = float(cross_entropy(device.model(x), y))

    # Assert: lambda weighs a distillation that is there
    assert total - ce > 1e-4


def test_the_inplace_term_teaches_both_sub_networks() -> None:
    # Prepare: the in-place term alone (the full network's CE subtracted out)
    device = make_device("inplace")
    device.model.eval()
    x, y = tiny_batch(device.data)
    parameters = dict(device.model.named_parameters())
    loss = device.local_loss(Task(ROUND, {}, {}))

    # Execute: gradient of (loss - CE(full)) = lambda * in-place term
    value, grads = value_and_gradients(lambda: loss(x, y) - cross_entropy(device.model(x), y), parameters)
    with torch.no_grad():
        shared, local = sub_network(device.model, x, False), sub_network(device.model, x, True)
        expected = LAM * 0.5 * (kl(device.model(x), shared) + kl(device.model(x), local))

    # Assert: the value is the in-place term, and both the shared and the personal entries learn from it
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    for keep_personal in (False, True):
        moved = [grads[n][personal_entries(n, p) if keep_personal else ~personal_entries(n, p)].abs().sum()
                 for n, p in parameters.items()]
        assert float(sum(moved)) > 0, "personal" if keep_personal else "shared"


def test_the_shared_sub_network_keeps_its_own_batchnorm_statistics_in_training() -> None:
    # Prepare: the statistics g_w0 starts from, and a copy that the reference's g_w0 pass updates
    device = make_device()
    device.model.train()
    x, y = tiny_batch(device.data)
    expected = {k: v.clone() for k, v in device.gw0_stats.items()}
    buffers = {k: v.clone() for k, v in device.model.named_buffers()}
    buffers.update({k: v.clone() for k, v in expected.items()})

    # Execute
    device.local_loss(Task(ROUND, {}, {}))(x, y)
    with torch.no_grad():
        sub_network(device.model, x, keep_personal=False, buffers=buffers)

    # Assert: g_w0's statistics moved, exactly as a pass of the shared sub-network moves them
    for key, value in device.gw0_stats.items():
        torch.testing.assert_close(value, buffers[key], msg=prefixed(key))
    assert any(not torch.equal(device.gw0_stats[k], expected[k]) for k in expected if "running_mean" in k)


def test_global_accuracy_scores_the_shared_sub_network() -> None:
    # Prepare
    device = make_device()
    device.model.eval()

    # Execute
    metrics = device.evaluate(Task(ROUND, {}, {}))
    with torch.no_grad():
        buffers = {k: v.clone() for k, v in device.model.named_buffers()}
        buffers.update(device.gw0_stats)
        logits = sub_network(device.model, device.test_x, keep_personal=False, buffers=buffers)
        personal = sub_network(device.model, device.test_x, keep_personal=True)

    # Assert
    assert metrics["global_accuracy"] == float((logits.argmax(1) == device.test_y).float().mean())
    assert not torch.equal(logits.argmax(1), personal.argmax(1))
