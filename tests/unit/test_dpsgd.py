"""DP-SGD on trainer devices (`edge_sdk.privacy.dpsgd`): per-example clipping, the noise's scale, the
accountant against dp-accounting called directly (and across a restart through the personal store),
the refusals, FedProx's proximal term, and a FedAvg device that trains under it.

Models are small and BatchNorm-free (`user_models.tiny_mlp`, hand-made linear layers): BatchNorm
is refused under DP-SGD, and the built-in CNNs have it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import cast

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import RdpAccountant
from torch import nn

from builtin_tasks import digits_client
from edge_sdk import training
from edge_sdk.algorithms import ALGORITHM_IDS, load
from edge_sdk.algorithms.fedavg import FedAvgDevice
from edge_sdk.algorithms.fedios import FediOSDevice, Hyper as FediOSHyper
from edge_sdk.algorithms.fedrep import FedRepDevice, FedRepHyper
from edge_sdk.algorithms.hyper import NoHyper
from edge_sdk.algorithms.repper import RepPerDevice
from edge_sdk.models import build_model
from edge_sdk.privacy.dpsgd import (ACCOUNTANT_KEY, DP_SGD_EPSILON, DpSgd, DpSgdAccountant, DpSgdRefused,
                                    PenalizedLoss, check_dp_sgd, dp_sgd, released_fit_metrics)
from edge_sdk.algorithms.base import Task
from edge_sdk.settings import TrainSettings
from edge_sdk.privacy.rdp import rdp_orders
from edge_sdk.store import PersonalState, PersonalStore
from edge_sdk.training import cross_entropy_loss, run_epochs
from user_models import tiny_cnn, tiny_mlp

ALLOWED = {"local", "fedavg", "fedavg_ft", "fedprox", "fedper", "fedrep", "lg_fedavg", "fedios", "fedbn", "fedbabu",
           "ditto"}
DELTA = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits():
    """All of the digits' training split on one device (1346 examples of 8x8)."""
    return digits_client(0, num_clients=1, partition="iid", seed=0)


def sgd_step(model: nn.Module, loss, x: torch.Tensor, y: torch.Tensor, trainer: DpSgd, *, batch_size: int,
             epochs: int = 1, seed: int = 0) -> torch.Tensor:
    """The change of `model`'s flat parameters after `epochs` of DP-SGD at lr 1 (no momentum)."""
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    with dp_sgd(trainer):
        run_epochs(loss, torch.optim.SGD(model.parameters(), lr=1.0), x, y, epochs=epochs, batch_size=batch_size,
                   generator=torch.Generator().manual_seed(seed), module=model)
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def direct_epsilon(*events: tuple[float, float, int]) -> float:
    """Epsilon at DELTA of Poisson-sampled Gaussian steps (q, z, steps), from dp-accounting itself."""
    accountant = RdpAccountant(list(rdp_orders()))  # the orders edgepfl's accountants use
    for rate, noise, steps in events:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise)), steps)
    return accountant.get_epsilon(DELTA)


# -- the mechanism -------------------------------------------------------------------------------------
def test_each_examples_gradient_is_clipped_to_the_bound_before_the_sum():
    # Prepare: loss = mean of w.x_i, so example i's gradient is x_i, of norms 5, 0.5 and 2
    model = nn.Linear(2, 1, bias=False)
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, -2.0]])
    y = torch.zeros(3, dtype=torch.long)
    clipped = torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, -1.0]])  # each scaled to norm <= 1 by hand

    # Execute: q = 1 (batch >= n), no noise, C = 1
    change = sgd_step(model, lambda xb, yb: model(xb).mean(), x, y, DpSgd(0.0, 1.0), batch_size=3)

    # Assert: one step of lr 1 on the clipped sum over the expected batch size (3)
    torch.testing.assert_close(change, -clipped.sum(dim=0) / 3, rtol=1e-5, atol=1e-6)


def test_without_noise_or_clipping_a_full_batch_step_is_plain_sgd_with_fedprox_penalty_after():
    # Prepare: a penalized loss (per-example cross-entropy + a parameter-only term) on two twins
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    twin = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])

    def penalized(net: nn.Module) -> PenalizedLoss:
        return PenalizedLoss(cross_entropy_loss(net),
                             lambda: 0.7 * cast(torch.Tensor, sum((p ** 2).sum() for p in net.parameters())))

    # Execute
    private = sgd_step(model, penalized(model), x, y, DpSgd(0.0, 1e9), batch_size=6)
    before = torch.cat([p.detach().flatten().clone() for p in twin.parameters()])
    run_epochs(penalized(twin), torch.optim.SGD(twin.parameters(), lr=1.0), x, y, epochs=1, batch_size=6,
               generator=torch.Generator().manual_seed(0))
    plain = torch.cat([p.detach().flatten() for p in twin.parameters()]) - before

    # Assert: the same step, the penalty's gradient included
    torch.testing.assert_close(private, plain, rtol=1e-4, atol=1e-6)


def test_the_noise_has_standard_deviation_z_times_c_over_the_expected_batch():
    # Prepare: zero per-example gradients on 400 coordinates; q = 1, n = 4; z = 2, C = 0.5
    model = nn.Linear(400, 1, bias=False)
    x, y = torch.ones(4, 400), torch.zeros(4, dtype=torch.long)
    trainer = DpSgd(2.0, 0.5, noise_seed=7)

    # Execute: 25 steps, each change recorded
    changes = torch.stack([sgd_step(model, lambda xb, yb: (model(xb) * 0).mean(), x, y, trainer, batch_size=4,
                                    seed=s) for s in range(25)])

    # Assert: 10,000 draws of N(0, (z C / 4)^2) = N(0, 0.25^2); the sample std within 4% (3 standard errors)
    assert changes.mean().abs() < 0.25 * 4 / math.sqrt(changes.numel())
    assert float(changes.std()) == pytest.approx(0.25, rel=0.04)
    assert trainer.accountant.steps == 25


def test_batches_are_poisson_samples_of_rate_batch_over_n():
    # Prepare: example i's gradient is e_i, so a step's clipped sum counts who was sampled
    n, batch, steps = 40, 10, 400
    model = nn.Linear(n, 1, bias=False)
    x, y = torch.eye(n), torch.zeros(n, dtype=torch.long)
    with torch.no_grad():
        model.weight.zero_()

    # Execute: no noise; the total change is -(times sampled) / (q n)
    change = sgd_step(model, lambda xb, yb: model(xb).mean(), x, y, DpSgd(0.0, 10.0), batch_size=batch,
                      epochs=steps // math.ceil(n / batch))

    # Assert: each example in about q x steps = 100 of the 400 steps (binomial, std 8.7); sizes vary
    sampled = -change * batch
    assert float(sampled.sum()) == pytest.approx(0.25 * n * steps, rel=0.05)
    assert sampled.min() > 60 and sampled.max() < 140 and sampled.std() > 4


def test_an_epochs_batches_vary_in_size_as_poisson_samples_do():
    # Prepare: as above; an epoch of 4 steps at q = 0.25 samples 40 examples on average, not always 40
    n, batch = 40, 10
    model = nn.Linear(n, 1, bias=False)
    x, y = torch.eye(n), torch.zeros(n, dtype=torch.long)

    # Execute: 20 epochs, one at a time, each from its own seed
    totals = []
    for seed in range(20):
        with torch.no_grad():
            model.weight.zero_()
        change = sgd_step(model, lambda xb, yb: model(xb).mean(), x, y, DpSgd(0.0, 10.0), batch_size=batch,
                          seed=seed)
        totals.append(round(float(-change.sum() * batch)))

    # Assert: the number sampled per epoch varies (binomial(160, 0.25): std 5.5); fixed batches give 40 always
    assert len(set(totals)) > 3
    assert 30 < sum(totals) / len(totals) < 50


def sampled_counts(trainer: DpSgd, *, seed: int, n: int = 40, batch: int = 10, epochs: int = 5) -> torch.Tensor:
    """How often each of `n` examples was sampled over `epochs` of DP-SGD without noise (example i's
    gradient is e_i), the training loop's generator seeded with `seed`."""
    model = nn.Linear(n, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    change = sgd_step(model, lambda xb, yb: model(xb).mean(), torch.eye(n), torch.zeros(n, dtype=torch.long),
                      trainer, batch_size=batch, epochs=epochs, seed=seed)
    return (-change * batch).round()


def seeded_counts(*, seed: int, n: int = 40, batch: int = 10, epochs: int = 5) -> torch.Tensor:
    """The counts the Poisson masks of the training loop's seeded generator give."""
    generator = torch.Generator().manual_seed(seed)
    steps = epochs * math.ceil(n / batch)
    return cast(torch.Tensor, sum((torch.rand(n, generator=generator) < batch / n).float() for _ in range(steps)))


def test_batches_are_secret_by_default_and_from_the_runs_seed_only_when_reproducible():
    # Execute: the same loop seed twice, secret batches and reproducible ones
    secret = [sampled_counts(DpSgd(0.0, 10.0), seed=5) for _ in range(2)]
    seeded = [sampled_counts(DpSgd(0.0, 10.0, reproducible=True), seed=5) for _ in range(2)]

    # Assert: secret batches are neither what the seed gives nor the same twice; reproducible ones are both
    predicted = seeded_counts(seed=5)
    assert not torch.equal(secret[0], predicted) and not torch.equal(secret[0], secret[1])
    assert torch.equal(seeded[0], predicted) and torch.equal(seeded[1], predicted)


def test_batches_from_the_runs_seed_are_accounted_without_amplification():
    # Prepare: q = 0.25, z = 1.1, 20 steps, batches from the run's seed
    secret, seeded = DpSgd(1.1, 10.0), DpSgd(1.1, 10.0, reproducible=True)

    # Execute
    for trainer in (secret, seeded):
        sampled_counts(trainer, seed=0)

    # Assert: q = 1 for the known batches (the Gaussian mechanism 20 times), q = 0.25 for the secret ones
    assert seeded.accountant.epsilon(DELTA) == pytest.approx(direct_epsilon((1.0, 1.1, 20)), rel=1e-12)
    assert secret.accountant.epsilon(DELTA) == pytest.approx(direct_epsilon((0.25, 1.1, 20)), rel=1e-12)
    assert seeded.accountant.epsilon(DELTA) > 2 * secret.accountant.epsilon(DELTA)


# -- the accountant --------------------------------------------------------------------------------------
def test_the_devices_epsilon_is_dp_accountings_for_the_same_rate_noise_and_steps():
    # Prepare: n = 50, batch 10: q = 0.2 and 5 steps per epoch
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(50, 3), torch.randint(0, 2, (50,))
    trainer = DpSgd(1.1, 1.0)

    # Execute
    sgd_step(model, cross_entropy_loss(model), x, y, trainer, batch_size=10, epochs=3)

    # Assert
    assert trainer.accountant.steps == 15
    assert trainer.accountant.epsilon(DELTA) == pytest.approx(direct_epsilon((0.2, 1.1, 15)), rel=1e-12)
    assert 0 < trainer.accountant.epsilon(DELTA) < math.inf


def test_the_accountant_goes_on_after_a_restart_through_the_personal_store(tmp_path):
    # Prepare: a device trains 2 epochs at batch 10, saves its state, and stops
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(50, 3), torch.randint(0, 2, (50,))
    first = DpSgd(0.9, 1.0)
    sgd_step(model, cross_entropy_loss(model), x, y, first, batch_size=10, epochs=2)
    store = PersonalStore(tmp_path, "dev0")
    store.save(PersonalState("dev0", "run", "fedavg", 1, first.accountant.to_arrays()))

    # Execute: a new process restores it and trains 1 epoch at batch 25 (q = 0.5, 2 steps)
    restored = PersonalStore(tmp_path, "dev0").restore("run", "fedavg")
    assert restored is not None
    second = DpSgd(0.9, 1.0, DpSgdAccountant.from_arrays(restored.arrays))
    sgd_step(model, cross_entropy_loss(model), x, y, second, batch_size=25, epochs=1)

    # Assert: the epsilon of every step of the run, before and after the restart
    assert second.accountant.steps == 12
    assert second.accountant.epsilon(DELTA) == pytest.approx(direct_epsilon((0.2, 0.9, 10), (0.5, 0.9, 2)),
                                                             rel=1e-12)
    assert second.accountant.epsilon(DELTA) > first.accountant.epsilon(DELTA)


def test_a_saved_history_that_cannot_be_is_refused():
    with pytest.raises(ValueError, match=ACCOUNTANT_KEY):
        DpSgdAccountant.from_arrays({ACCOUNTANT_KEY: np.array([[1.5, 1.0, 3.0]])})
    assert DpSgdAccountant.from_arrays({}).epsilon(DELTA) == 0.0


# -- what may train with it -------------------------------------------------------------------------------
def test_algorithms_whose_loss_is_not_per_example_are_refused_by_name(digits):
    # Prepare
    model = build_model(tiny_mlp, digits.task, seed=0)

    # Execute / Assert
    for algorithm_id in ALGORITHM_IDS:
        cls = load(algorithm_id)
        if algorithm_id in ALLOWED:
            check_dp_sgd(cls, model)
        else:
            with pytest.raises(DpSgdRefused, match=f"refused for {algorithm_id}: "):
                check_dp_sgd(cls, model)
    with pytest.raises(DpSgdRefused, match="repper: its supervised contrastive loss pairs every example"):
        check_dp_sgd(RepPerDevice, model)


def test_a_model_with_batchnorm_is_refused_naming_its_first_batchnorm(digits):
    with pytest.raises(DpSgdRefused, match=r"module 'body\.1' \(BatchNorm2d\)"):
        check_dp_sgd(FedAvgDevice, build_model(tiny_cnn, digits.task, seed=0))


def test_a_trainers_own_loss_is_refused(digits):
    with pytest.raises(DpSgdRefused, match="own loss"):
        check_dp_sgd(FedAvgDevice, build_model(tiny_mlp, digits.task, seed=0), own_loss=True)


def test_a_loop_that_names_no_module_is_refused():
    model = nn.Linear(2, 2)
    with dp_sgd(DpSgd(1.0, 1.0)), pytest.raises(DpSgdRefused, match="module"):
        run_epochs(cross_entropy_loss(model), torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 2),
                   torch.zeros(4, dtype=torch.long), epochs=1, batch_size=2, generator=torch.Generator())


# -- devices ---------------------------------------------------------------------------------------------
def train_loss(device) -> float:
    with torch.no_grad(), training.eval_mode(device.model):
        return float(nn.functional.cross_entropy(device.model(device.train_x), device.train_y))


def test_a_fedavg_device_learns_under_dp_sgd_and_uploads_what_it_would_without(digits):
    # Prepare: two identical devices; batch 128 (q = 0.095), z = 0.8, C = 1
    settings = TrainSettings(model="cnn8", rounds=2, local_epochs=2, batch_size=128, lr=0.5, seed=0)
    private, plain = (FedAvgDevice(NoHyper(), settings, digits, "cpu", client_seed=3, model=tiny_mlp)
                      for _ in range(2))
    trainer = DpSgd(0.8, 1.0, noise_seed=1)
    before = train_loss(private)

    # Execute
    with dp_sgd(trainer):
        result = private.fit(Task(1, {}, {}))
    reference = plain.fit(Task(1, {}, {}))

    # Assert: it learned, the upload has the same groups, names, shapes and types, and the steps are counted
    assert train_loss(private) < 0.7 * before
    assert result.groups.keys() == reference.groups.keys()
    for name, group in result.groups.items():
        assert {k: (v.shape, v.dtype) for k, v in group.items()} == \
            {k: (v.shape, v.dtype) for k, v in reference.groups[name].items()}
    assert trainer.accountant.steps == 2 * math.ceil(len(digits.train_y) / 128)
    released = released_fit_metrics(result.metrics, trainer.accountant.epsilon(DELTA))
    assert set(released) == {"num_examples", DP_SGD_EPSILON} and 0 < released[DP_SGD_EPSILON] < math.inf


def test_a_fedios_device_takes_its_three_cross_entropies_per_example(digits):
    # Prepare: FediOS's head runs three times per pass; without noise or clipping at q = 1 DP-SGD is plain GD
    small = dataclasses.replace(digits, train_x=digits.train_x[:64], train_y=digits.train_y[:64])
    settings = TrainSettings(model="cnn8", rounds=2, local_epochs=1, batch_size=64, lr=0.1, seed=0)
    devices = [FediOSDevice(FediOSHyper(lam=0.5, l_re="extractors"), settings, small, "cpu", client_seed=3,
                            assignment={"block": 1, "capacity": 2}, model=tiny_mlp) for _ in range(2)]

    # Execute
    with dp_sgd(DpSgd(0.0, 1e9)):
        private = devices[0].fit(Task(1, {}, {}))
    plain = devices[1].fit(Task(1, {}, {}))

    # Assert
    for key, value in plain.groups["shared"].items():
        np.testing.assert_allclose(private.groups["shared"][key], value, rtol=1e-4, atol=1e-6)


def test_fedrep_trains_only_each_phases_own_parameters_and_leaves_no_opacus_state(digits):
    # Prepare: the head phase (on body features) and the body phase (head frozen), one epoch each
    settings = TrainSettings(model="cnn8", rounds=2, local_epochs=1, batch_size=128, lr=0.1, seed=0)
    device = FedRepDevice(FedRepHyper(head_epochs=1), settings, digits, "cpu", client_seed=3, model=tiny_mlp)
    trainer = DpSgd(1.0, 1.0, noise_seed=2)

    # Execute
    with dp_sgd(trainer):
        device.fit(Task(1, {}, {}))

    # Assert: both phases' steps counted; every parameter trainable again, no per-example state left
    assert trainer.accountant.steps == 2 * math.ceil(len(digits.train_y) / 128)
    for param in device.model.parameters():
        assert param.requires_grad
        assert not {"grad_sample", "summed_grad", "_forward_counter"} & set(vars(param))
