"""The papers' ablations as hyperparameters (issue 23): each switch changes exactly what it names.

DualFed: `schedule="simultaneous"` trains every part in one pass on both stages' losses;
`projector=false` removes the projector. FediOS: `personal_extractor=false` leaves phi_p = 0 and
phi_f = phi_g (its loss, CE(head(phi_g)) alone, is proved in test_fedios_objective.py). CD2-pFed:
`ramp=false` keeps p_t = p from round 1 (test_cd2_pfed.py). Existing values that express an
ablation exactly: DC-PFL `lam=0` (no auxiliary loss) and `calibration_epochs=0` (no Eq. 12 step);
CD2-pFed `lam=0` (no L_CD) and `beta=1, warmup=0` (no EMA). Bad values are refused naming the key.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from builtin_tasks import DIGITS, digits_client
from coordinator.algorithms import hyperparameters
from coordinator.algorithms.base import ServerContext
from coordinator.algorithms.cd2_pfed import CD2PFedServer
from coordinator.algorithms.dc_pfl import DcPflServer
from coordinator.algorithms.dualfed import DualFedServer
from coordinator.algorithms.fedios import FediOSServer
from coordinator.rounds.inprocess import FixedUpdate, play_round
from edge_sdk.algorithms import cd2_pfed, dc_pfl, dualfed, fedios
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.dc_pfl import STATS, CovarianceMode, class_statistics, encode_stats
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.augment import task_views
from edge_sdk.losses import supcon_loss
from edge_sdk.settings import TrainSettings
from edge_sdk.training import eval_mode

SETTINGS = TrainSettings(model="cnn8", rounds=3, local_epochs=1, batch_size=32, lr=0.05, seed=0)


def client(index: int = 0):
    return digits_client(index, num_clients=10, partition="dirichlet", seed=0)


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def changed(before: dict[str, torch.Tensor], module: nn.Module) -> bool:
    after = module.state_dict()
    return any(not torch.equal(before[k], after[k]) for k in before)


# -- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm, key, value", [
    ("dualfed", "schedule", "jointly"),
    ("dualfed", "projector", "maybe"),
    ("fedios", "personal_extractor", "sometimes"),
    ("cd2_pfed", "ramp", "sometimes"),
])
def test_a_bad_switch_value_is_refused_naming_its_key(algorithm: str, key: str, value: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=key):
        hyperparameters(algorithm, {key: value})


def test_dualfed_refuses_a_projector_size_without_a_projector() -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="projector_hidden"):
        hyperparameters("dualfed", {"projector": "false", "projector_hidden": "16"})


# -- DualFed -----------------------------------------------------------------------------------
def dualfed_device(**hyper) -> dualfed.DualFedDevice:
    return dualfed.DualFedDevice(dualfed.Hyper(**hyper), SETTINGS, client(), "cpu", client_seed=100)


def test_dualfed_without_projector_has_none_and_its_head_reads_z() -> None:
    # Prepare
    device = dualfed_device(projector=False)
    server = DualFedServer(device.hyper, ServerContext("cnn8", DIGITS, seed=0, rounds=3, clients=10))
    x = torch.as_tensor(device.data.test_x[:8])

    # Execute
    result = device.fit(Task(1, server.task_groups(1), {}))
    with eval_mode(device.model):
        _, personal_logits = device.model(x)
        on_z = device.model.head(device.model.body(x))

    # Assert: no projector parameters anywhere (model, personal state, upload); u = z
    assert isinstance(device.model.projector, nn.Identity)
    assert not any(name.startswith("projector.") for name in device.model.state_dict())
    assert not any("projector" in key for key in device.personal_state())
    assert set(result.groups[SHARED]) == set(server.state[SHARED])
    torch.testing.assert_close(personal_logits, on_z)


def test_dualfed_stagewise_runs_both_stages_and_simultaneous_neither(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: record which training routines run
    calls: list[str] = []
    for name in ("train_main_branch", "train_global_head", "train_simultaneously"):
        real = getattr(dualfed.DualFedDevice, name)
        def recorded(self, generator, _real=real, _name=name):
            calls.append(_name)
            return _real(self, generator)

        monkeypatch.setattr(dualfed.DualFedDevice, name, recorded)
    server = DualFedServer(dualfed.Hyper(), ServerContext("cnn8", DIGITS, seed=0, rounds=3, clients=10))

    # Execute
    dualfed_device().fit(Task(1, server.task_groups(1), {}))
    stagewise, calls[:] = list(calls), []
    dualfed_device(schedule="simultaneous").fit(Task(1, server.task_groups(1), {}))

    # Assert
    assert stagewise == ["train_main_branch", "train_global_head"]
    assert calls == ["train_simultaneously"]


def test_dualfed_simultaneous_trains_every_part_on_both_losses_at_once() -> None:
    # Prepare
    device = dualfed_device(schedule="simultaneous")
    before = {part: snapshot(getattr(device.model, part)) for part in dualfed.ALL_PARTS}
    x, y = torch.as_tensor(device.data.train_x[:16]), torch.as_tensor(device.data.train_y[:16])

    # Execute: the loss against a hand-built Eq. (8) + CE(global_head(z)) on the same views
    device.model.train()
    value = device.main_branch_loss(torch.Generator().manual_seed(5), with_global_head=True)(x, y)
    torch.manual_seed(0)
    views = task_views(x, device.data.task, torch.Generator().manual_seed(5)).flatten(0, 1)
    z = device.model.body(views)
    u = device.model.projector(z)
    labels = y.repeat_interleave(2)
    expected = (F.cross_entropy(device.model.head(u), labels)
                + device.hyper.lam * supcon_loss(u.view(16, 2, -1), y, device.hyper.temperature, variant="out")
                + F.cross_entropy(device.model.global_head(z), labels))
    loss = device.train_simultaneously(device.generator(1))

    # Assert: the value, and one pass moved all four parts, global_head's gradient reaching the body
    torch.testing.assert_close(value, expected)
    assert np.isfinite(loss)
    for part in dualfed.ALL_PARTS:
        assert changed(before[part], getattr(device.model, part)), part
    device.model.zero_grad()
    device.main_branch_loss(torch.Generator().manual_seed(5), with_global_head=True)(x, y).backward()
    assert device.model.global_head.weight.grad is not None and device.model.global_head.weight.grad.abs().sum() > 0


# -- FediOS ------------------------------------------------------------------------------------
def fedios_device(**hyper) -> fedios.FediOSDevice:
    settings = TrainSettings("cnn8", rounds=5, local_epochs=1, batch_size=32, lr=0.05, seed=0)
    return fedios.FediOSDevice(fedios.Hyper(**hyper), settings, client(), "cpu", client_seed=7,
                               assignment={"block": 1, "capacity": 3})


def test_fedios_without_personal_extractor_is_the_generic_path_alone() -> None:
    # Prepare
    device = fedios_device(personal_extractor=False, alpha=0.3)
    server = FediOSServer(fedios.Hyper(capacity=3), ServerContext("cnn8", DIGITS, seed=0, rounds=5, clients=3))
    x = torch.as_tensor(device.data.test_x[:8])

    # Execute
    result = device.fit(Task(1, server.task_groups(1), {}))
    metrics = device.evaluate(Task(1, server.task_groups(1), {}))
    with eval_mode(device.model):
        phi_p = device.model.personal_features(x)
        fused, generic = device.model(x), device.model.global_logits(x)

    # Assert: no personal parameters; phi_p = 0; phi_f = phi_g whatever alpha; the upload is unchanged
    assert list(device.model.personal_body.parameters()) == []
    assert torch.count_nonzero(phi_p) == 0
    torch.testing.assert_close(fused, generic)
    assert metrics["accuracy"] == metrics["global_accuracy"]
    assert set(result.groups[SHARED]) == set(fedios_device().fit(Task(1, server.task_groups(1), {})).groups[SHARED])


def test_fedios_with_personal_extractor_fuses_a_nonzero_personal_feature() -> None:
    # Prepare
    device = fedios_device()
    x = torch.as_tensor(device.data.test_x[:8])

    # Execute
    with eval_mode(device.model):
        phi_p = device.model.personal_features(x)
        fused, generic = device.model(x), device.model.global_logits(x)

    # Assert: the switch's default keeps the personal path
    assert len(list(device.model.personal_body.parameters())) > 0
    assert torch.count_nonzero(phi_p) > 0
    assert not torch.allclose(fused, generic)


# -- DC-PFL: lam=0 and calibration_epochs=0 ---------------------------------------------------
def test_dc_pfl_lam_zero_is_plain_cross_entropy() -> None:
    # Prepare: global means for every class, so that lam > 0 would add a term
    data = client(1)
    device = dc_pfl.DcPflDevice(dc_pfl.Hyper(lam=0.0), SETTINGS, data, "cpu", client_seed=1)
    x, y = torch.as_tensor(data.train_x[:16]), torch.as_tensor(data.train_y[:16])
    assert device.model.feature_dim is not None
    means = (torch.randn(10, device.model.feature_dim, generator=torch.Generator().manual_seed(0)),
             torch.ones(10, dtype=torch.bool))

    # Execute
    with torch.no_grad(), eval_mode(device.model):
        value = device.local_loss(means)(x, y)
        plain = F.cross_entropy(device.model(x), y)

    # Assert
    torch.testing.assert_close(value, plain, rtol=0, atol=0)


def dc_pfl_server_after_a_round(hyper: dc_pfl.Hyper) -> DcPflServer:
    rng = np.random.default_rng(3)
    uploads = {}
    for cid in ("dev000", "dev001"):
        labels = rng.integers(0, 10, size=60)
        uploads[cid] = encode_stats(*class_statistics(rng.normal(size=(60, 128)), labels, 10),
                                    CovarianceMode("full"), "float32")
    server = DcPflServer(hyper, ServerContext("cnn8", DIGITS, seed=0, rounds=2, clients=10))
    play_round(server, {cid: FixedUpdate({STATS: upload}, 60) for cid, upload in uploads.items()}, 1)
    return server


def test_dc_pfl_calibration_epochs_zero_skips_exactly_the_calibration_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Execute: calibration_epochs=0; the default; the default with the calibration step removed
    without = dc_pfl_server_after_a_round(dc_pfl.Hyper(calibration_epochs=0)).state[SHARED]
    default = dc_pfl_server_after_a_round(dc_pfl.Hyper()).state[SHARED]
    monkeypatch.setattr(DcPflServer, "_calibrate", lambda self, *args: float("nan"))
    removed = dc_pfl_server_after_a_round(dc_pfl.Hyper()).state[SHARED]

    # Assert
    for name in default:
        np.testing.assert_array_equal(without[name], removed[name])
    assert any(not np.array_equal(without[name], default[name]) for name in default)


# -- CD2-pFed: lam=0, and beta=1 with warmup=0 --------------------------------------------------
def cd2_device(**hyper) -> cd2_pfed.CD2PFedDevice:
    settings = TrainSettings("cnn8", rounds=10, local_epochs=1, batch_size=32, lr=0.05, seed=0)
    return cd2_pfed.CD2PFedDevice(cd2_pfed.Hyper(**hyper), settings, client(), "cpu", client_seed=3)


def test_cd2_pfed_lam_zero_is_the_full_network_cross_entropy() -> None:
    # Prepare
    device = cd2_device(lam=0.0)
    server = CD2PFedServer(device.hyper, ServerContext("cnn8", DIGITS, seed=0, rounds=10, clients=10))
    task = Task(5, server.task_groups(5), {})
    x, y = torch.as_tensor(device.data.train_x[:16]), torch.as_tensor(device.data.train_y[:16])

    # Execute
    with torch.no_grad(), eval_mode(device.model):
        value = device.local_loss(task)(x, y)
        plain = F.cross_entropy(device.model(x), y)

    # Assert
    torch.testing.assert_close(value, plain, rtol=0, atol=0)


def test_cd2_pfed_beta_one_and_no_warmup_is_no_smoothing() -> None:
    # Prepare
    device = cd2_device(beta=1.0, warmup=0.0)
    masks = device.masks(5)
    before = {k: p.detach().clone() + 1.0 for k, p in device.model.named_parameters()}
    trained = snapshot(device.model)

    # Execute
    coefficients = [cd2_pfed.ema_coefficient(1.0, t, 10, 0.0) for t in range(1, 11)]
    device.smooth_personal(before, masks, coefficients[4])

    # Assert: beta_t = 1 in every round, and the personal entries stay as trained
    assert coefficients == [1.0] * 10
    assert not changed(trained, device.model)
    assert cd2_pfed.ema_coefficient(1.0, 1, 20, 0.1) < 1.0  # beta=1 with the ramp would still smooth round 1
    device.smooth_personal(before, masks, 0.5)
    assert changed(trained, device.model)  # and the default beta moves the personal entries
