"""CD2-pFed mechanics on tiny data: the split schedule (with and without Eq. 3's ramp), the upload
mask, the loss, the EMA."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from builtin_tasks import digits_client
from coordinator.algorithms.base import ServerContext
from coordinator.algorithms.cd2_pfed import CD2PFedServer
from coordinator.rounds.inprocess import FixedUpdate, play_round
from edge_sdk import wire
from edge_sdk.settings import TrainSettings
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.cd2_pfed import (
    CD2PFedDevice,
    Hyper,
    cyclic_distillation,
    ema_coefficient,
    personal_fraction,
)
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.params import check_arrays
from edge_sdk.protocol import Envelope, Kind

ROUNDS = 15
MARKER = np.float32(7.25)


@pytest.fixture(scope="module")
def data():
    return digits_client(0, num_clients=10, partition="dirichlet", seed=0)


def make_device(data, *, lr: float = 0.05, rounds: int = ROUNDS, client_seed: int = 11, **hyper) -> CD2PFedDevice:
    settings = TrainSettings("cnn8", rounds, local_epochs=1, batch_size=32, lr=lr, seed=0)
    return CD2PFedDevice(Hyper(**hyper), settings, data, "cpu", client_seed=client_seed)


def make_server(data, rounds: int = ROUNDS, **hyper) -> CD2PFedServer:
    return CD2PFedServer(Hyper(**hyper), ServerContext("cnn8", data.task, seed=0, rounds=rounds, clients=10))


def test_personal_fraction_is_p_t_over_T() -> None:
    # Prepare
    rounds = range(0, ROUNDS + 1)

    # Execute
    fractions = [personal_fraction(0.5, t, ROUNDS) for t in rounds]

    # Assert
    assert fractions == pytest.approx([0.5 * t / ROUNDS for t in rounds])
    assert fractions[-1] == pytest.approx(0.5)


def test_without_the_ramp_the_personal_fraction_is_p_from_round_1() -> None:
    # Execute
    fractions = [personal_fraction(0.5, t, ROUNDS, ramp=False) for t in range(0, ROUNDS + 1)]

    # Assert: the whole model is shared before round 1, p from then on
    assert fractions == [0.0] + [0.5] * ROUNDS


# round -> personal channels of the cnn8 layers with 32, 64 and 128 outputs (round(p_t * C))
EXPECTED_COUNTS = {1: (1, 2, 4), 8: (9, 17, 34), 15: (16, 32, 64)}
WITHOUT_RAMP = (16, 32, 64)
"""round(p * C) in every round when p_t = p from round 1 (`ramp=False`)."""


@pytest.mark.parametrize("ramp", [True, False])
@pytest.mark.parametrize("round_", sorted(EXPECTED_COUNTS))
def test_last_channels_of_each_layer_are_personal(data, round_: int, ramp: bool) -> None:
    # Prepare
    device = make_device(data, ramp=ramp)
    n32, n64, n128 = EXPECTED_COUNTS[round_] if ramp else WITHOUT_RAMP

    # Execute
    masks = device.masks(round_)

    # Assert: output rows of body layers (BN follows its conv), input columns of the head
    for key, n in [("body.0.weight", n32), ("body.1.weight", n32), ("body.1.bias", n32),
                   ("body.3.weight", n64), ("body.4.weight", n64), ("body.8.weight", n128), ("body.8.bias", n128)]:
        rows = masks[key].reshape(masks[key].shape[0], -1).all(dim=1)
        assert rows.sum().item() == n, key
        assert rows[-n:].all() and not rows[:-n].any(), key
    head_columns = masks["head.weight"].all(dim=0)
    assert head_columns.sum().item() == n128 and head_columns[-n128:].all()
    assert not masks["head.bias"].any()


def test_upload_carries_only_the_shared_slices(data) -> None:
    # Prepare: lr 1e-30 (too small to move a float32 weight) leaves the weights as set; the
    # personal entries hold a marker value
    round_ = 8
    device, server = make_device(data, lr=1e-30), make_server(data)
    masks = device.masks(round_)
    with torch.no_grad():
        for key, param in device.model.named_parameters():
            param[masks[key]] = float(MARKER)
    marker_bytes = np.full(4, MARKER, dtype=np.float32).tobytes()

    # Execute
    result = device.fit(Task(round_, {}, {}))
    payload = wire.encode(Envelope(Kind.TRAIN_RES, "dev000", groups=result.groups, metrics=result.metrics))

    # Assert: exactly the shapes the server expects, no marker in the upload, but in the model
    check_arrays(SHARED, result.groups[SHARED], server.update_spec(round_)[SHARED])
    assert result.groups[SHARED]["body.8.weight"].shape == (128 - 34, 1024)
    assert result.groups[SHARED]["head.weight"].shape == (10, 128 - 34)
    assert marker_bytes not in payload
    personal = {k: v for k, v in device.personal_state().items() if k in result.groups[SHARED]}
    assert marker_bytes in wire.encode(Envelope(Kind.TRAIN_RES, "dev000", groups={"all": personal}))


def test_uploads_shrink_as_the_personal_fraction_grows(data) -> None:
    # Prepare
    server = make_server(data)

    # Execute
    sizes = [sum(math.prod(shape) for shape, _ in server.update_spec(t)[SHARED].values()) for t in (1, 8, 15)]

    # Assert
    assert sizes[0] > sizes[1] > sizes[2]


def test_a_run_without_the_ramp_uploads_the_smallest_slices_from_round_1(data) -> None:
    # Prepare
    ramped_server, ramped = make_server(data), {"dev000": make_device(data)}
    server, devices = make_server(data, ramp=False), {"dev000": make_device(data, ramp=False)}

    # Execute: rounds 1-2 without the ramp, round 1 with it; the server checks every upload
    # against its own update_spec (a mismatch raises)
    without = [play_round(server, devices, round_) for round_ in (1, 2)]
    ramped_first = play_round(ramped_server, ramped, 1)

    # Assert: without the ramp, round 1 already carries p_T's slices (the ramp's last round),
    # fewer bytes than the ramp's round 1, and round 2 the same
    smallest = make_server(data).update_spec(ROUNDS)[SHARED]
    first = without[0].results["dev000"]
    assert {k: v.shape for k, v in first.groups[SHARED].items()} == {k: shape for k, (shape, _) in smallest.items()}
    assert first.metrics["personal_fraction"] == pytest.approx(0.5)
    assert without[0].bytes_up["dev000"] < 0.6 * ramped_first.bytes_up["dev000"]
    assert without[1].bytes_up["dev000"] == without[0].bytes_up["dev000"]


def test_server_averages_entry_by_entry_and_device_loads_leading_slices(data) -> None:
    # Prepare
    round_ = 15
    server, device = make_server(data), make_device(data)
    spec = server.update_spec(round_)[SHARED]
    first = {k: np.full(shape, 1.0, dtype=np.float32) for k, (shape, _) in spec.items()}
    second = {k: np.full(shape, 4.0, dtype=np.float32) for k, (shape, _) in spec.items()}
    before = {k: p.detach().clone() for k, p in device.model.named_parameters()}

    # Execute
    play_round(server, {"a": FixedUpdate({SHARED: first}, 2), "b": FixedUpdate({SHARED: second}, 1)}, round_)
    device.load_shared(Task(round_ + 1, server.task_groups(round_ + 1), {}))

    # Assert: (2 * 1 + 1 * 4) / 3 = 2 in every shared entry (to float32 rounding: the server sums
    # changes from the broadcast state); personal entries untouched
    assert all(np.allclose(v, 2.0) and v.shape == spec[k][0] for k, v in server.state[SHARED].items())
    for key, param in device.model.named_parameters():
        mask = device.masks(round_)[key]
        assert torch.allclose(param[~mask], torch.tensor(2.0), rtol=0, atol=1e-6), key
        assert torch.equal(param[mask], before[key][mask]), key


def test_cyclic_distillation_detaches_the_target_of_each_kl() -> None:
    # Prepare
    generator = torch.Generator().manual_seed(0)
    local = torch.randn(4, 10, generator=generator, requires_grad=True)
    global_ = torch.randn(4, 10, generator=generator, requires_grad=True)
    p_local, p_global = F.softmax(local, dim=1), F.softmax(global_, dim=1)

    # Execute
    loss = cyclic_distillation(local, global_)
    loss.backward()

    # Assert: value 1/2 (KL(pL||pG) + KL(pG||pL)); each side gets only the gradient of the
    # term in which it is the student: d/dz KL(p || softmax(z)) = softmax(z) - p
    kl = lambda p, q: (p * (p.log() - q.log())).sum(dim=1).mean()  # noqa: E731
    assert loss.item() == pytest.approx(0.5 * (kl(p_local, p_global) + kl(p_global, p_local)).item(), rel=1e-5)
    torch.testing.assert_close(global_.grad, 0.5 * (p_global - p_local).detach() / 4)
    torch.testing.assert_close(local.grad, 0.5 * (p_local - p_global).detach() / 4)


def test_ema_coefficient_ramps_up_until_t0() -> None:
    # Prepare: T = 50, t0 = 5
    rounds, beta = 50, 0.5

    # Execute
    betas = [ema_coefficient(beta, t, rounds, warmup=0.1) for t in range(1, rounds + 1)]

    # Assert
    assert betas[0] == pytest.approx(beta * math.exp(-5 * (1 - 1 / 5) ** 2))
    assert betas[2] == pytest.approx(beta * math.exp(-5 * (1 - 3 / 5) ** 2))
    assert all(a < b for a, b in zip(betas[:4], betas[1:5], strict=True))
    assert betas[4:] == pytest.approx([beta] * (rounds - 4))


def test_ema_smooths_only_the_personal_entries(data) -> None:
    # Prepare
    device = make_device(data)
    masks = device.masks(8)
    new = {k: p.detach().clone() for k, p in device.model.named_parameters()}
    before = {k: v + 1.0 for k, v in new.items()}

    # Execute
    device.smooth_personal(before, masks, beta_t=0.25)

    # Assert: personal = 0.25 new + 0.75 before = new + 0.75; shared entries unchanged
    for key, param in device.model.named_parameters():
        torch.testing.assert_close(param[masks[key]], new[key][masks[key]] + 0.75)
        torch.testing.assert_close(param[~masks[key]], new[key][~masks[key]])


def test_fit_and_evaluate_report_personal_and_global_accuracy(data) -> None:
    # Prepare
    device, server = make_device(data), make_server(data)

    # Execute
    result = device.fit(Task(1, server.task_groups(1), {}))
    metrics = device.evaluate(Task(1, server.eval_groups(), {}))

    # Assert
    assert result.metrics["num_examples"] == data.num_train
    assert result.metrics["personal_fraction"] == pytest.approx(0.5 / ROUNDS)
    assert 0.0 <= metrics["accuracy"] <= 1.0 and 0.0 <= metrics["global_accuracy"] <= 1.0
    assert metrics["num_test"] == data.num_test


def test_personal_state_round_trip_restores_the_model_and_g_w0_statistics(data) -> None:
    # Prepare
    trained = make_device(data)
    trained.fit(Task(3, {}, {}))
    saved = trained.personal_state()
    fresh = make_device(data)

    # Execute
    fresh.load_personal_state(saved)

    # Assert
    restored = fresh.personal_state()
    assert set(restored) == set(saved)
    assert all(np.array_equal(restored[k], saved[k]) for k in saved)
    assert any(k.startswith("g_w0.") for k in saved)


def test_an_unknown_distillation_form_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="distillation must be one of cyclic\\+inplace, inplace, cyclic"):
        Hyper(distillation="mutual")  # type: ignore[arg-type]  # not a form, on purpose: refused at runtime
