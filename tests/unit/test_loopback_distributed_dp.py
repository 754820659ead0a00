"""Distributed DP under secure aggregation over the loopback broker: each device adds its share
N(0, z^2 C^2 / m) before masking, the unmasked mean carries the noise of z C / m per coordinate,
a round with a device lost is accounted with the noise it really holds, and what cannot be
private this way is refused by name."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from coordinator.privacy.accountant import PrivacyAccountant, local_epsilon
from edge_sdk.config import ConfigError
from coordinator.privacy.run import RunPrivacy
from edge_sdk.privacy import PrivacySettings
from edge_sdk.privacy.rdp import rdp_orders
from edge_sdk.privacy.upstream import NOISE_SHARES, UploadPrivacy, private_metrics
from edge_sdk.protocol import Kind
from loopback_runs import BlockingLock, drain
from saved_runs import checkpoint_at
from secure_fleets import DEVICES, fleet_keys, start_with_the_last_lost

CLIP = 0.01
NOISE = 40.0
DELTA = 1e-9


def distributed_config(federation, **changes):
    settings = dict(clients=DEVICES, secure_aggregation=True, dp="distributed", dp_clip=CLIP, dp_noise=NOISE,
                    dp_delta=DELTA, dp_evaluation="outside", aggregation_dtype="float64", rounds=1)
    return federation.config(**{**settings, **changes})


def shared_change(federation, coordinator) -> np.ndarray:
    """The global shared state's change over the run, every floating value in one vector."""
    state = checkpoint_at(federation.folder.checkpoint).state["shared"]
    initial = type(coordinator.algorithm)(coordinator.hyper, coordinator.algorithm.context).state["shared"]
    return np.concatenate([(state[k].astype(np.float64) - initial[k]).ravel() for k in sorted(state)
                           if state[k].dtype.kind == "f"])


def test_the_secure_mean_carries_the_devices_noise_shares_summed(federation):
    # Prepare
    coordinator = federation.coordinator(distributed_config(federation))
    for i, keys in enumerate(fleet_keys(DEVICES)):
        federation.start_device(i, DEVICES, secagg_keys=keys)

    # Execute
    report = coordinator.run()

    # Assert: one round of all four; the mean moved by noise of std z C / m per coordinate (the
    # clipped changes, norm <= C over all coordinates, add nothing visible), epsilon as accounted
    assert report["rounds"][0]["participants"] == DEVICES and report["rounds"][0]["secagg"]["unmasked"] == DEVICES
    change = shared_change(federation, coordinator)
    assert change.size > 5000
    assert np.std(change) == pytest.approx(NOISE * CLIP / DEVICES, rel=0.05)
    expected = PrivacyAccountant("rdp", "fixed", DELTA)
    expected.add_round(DEVICES, DEVICES, NOISE)
    assert report["privacy"]["epsilon"] == pytest.approx(expected.epsilon(), rel=1e-9)
    assert report["privacy"]["mode"] == "distributed"


def test_a_round_with_a_device_lost_is_accounted_with_the_noise_its_sum_holds(federation):
    # Prepare: dev003 is parked in its training, then announced offline after sharing its keys
    parked = BlockingLock()
    coordinator = federation.coordinator(distributed_config(federation, min_clients=3))
    start_with_the_last_lost(federation, parked)

    # Execute
    report = coordinator.run()
    parked.release.set()

    # Assert: three shares in the sum, noise z sqrt(3/4) accounted; the mean's noise as much over m = 4
    assert report["rounds"][0]["participants"] == DEVICES - 1
    expected = PrivacyAccountant("rdp", "fixed", DELTA)
    expected.add_round(DEVICES, DEVICES, NOISE * np.sqrt((DEVICES - 1) / DEVICES))
    assert report["privacy"]["epsilon"] == pytest.approx(expected.epsilon(), rel=1e-9)
    full = PrivacyAccountant("rdp", "fixed", DELTA)
    full.add_round(DEVICES, DEVICES, NOISE)
    assert report["privacy"]["epsilon"] > full.epsilon()
    held = local_epsilon("fixed", NOISE * np.sqrt((DEVICES - 1) / DEVICES), 1, DELTA)
    assert report["privacy"]["epsilon_fleet"] == pytest.approx(held, rel=1e-9)
    assert report["privacy"]["epsilon_fleet"] > local_epsilon("fixed", NOISE, 1, DELTA)
    change = shared_change(federation, coordinator)
    assert np.std(change) == pytest.approx(NOISE * CLIP * np.sqrt((DEVICES - 1) / DEVICES) / DEVICES, rel=0.05)


@pytest.mark.parametrize(("changes", "named"), [
    (dict(secure_aggregation=False), "dp distributed: .*secure aggregation"),
    (dict(dp="central"), "secure_aggregation: dp central"),
    (dict(dp="local"), "secure_aggregation: dp local"),
    (dict(dp_adaptive_clip=True), "dp_adaptive_clip"),
])
def test_what_distributed_dp_cannot_cover_is_refused_by_name(federation, changes, named):
    with pytest.raises(ConfigError, match=named):
        federation.coordinator(distributed_config(federation, **changes))


def test_a_device_s_share_of_the_noise_is_z_c_over_the_root_of_m():
    privacy = UploadPrivacy("distributed", clip=0.1, noise=2.0, evaluation="outside", eval_noise=0.0,
                            reproducible=True, seed=0)
    assert privacy.noise_std(0.1, {NOISE_SHARES: 16}) == pytest.approx(2.0 * 0.1 / 4)
    assert UploadPrivacy("local", 0.1, 2.0, "outside", 0.0, True, 0).noise_std(0.1, {}) == pytest.approx(0.2)
    assert UploadPrivacy("central", 0.1, 2.0, "outside", 0.0, True, 0).noise_std(0.1, {}) == 0.0
    with pytest.raises(ValueError, match=NOISE_SHARES):
        privacy.noise_std(0.1, {})


def test_the_fleets_epsilon_composes_each_round_at_the_noise_its_sum_held():
    # Prepare: 4 devices, all 4 expected a round; z = 3
    settings = PrivacySettings(dp="distributed", dp_noise=3.0, dp_evaluation="outside")
    privacy = RunPrivacy(settings, devices=4, population=4, fraction=1.0, rounds=3, evaluations=0, seed=0)

    # Execute: rounds summed over 4, 2 and 1 devices; dev0 in all three, the others in fewer
    for round_, summed in enumerate((["dev0", "dev1", "dev2", "dev3"], ["dev0", "dev1"], ["dev0"]), start=1):
        privacy.note_secure_sum(len(summed))
        privacy.round_ended(4, summed, round_)

    # Assert: dev0's three Gaussian mechanisms, replace-one (sensitivity 2C), at z sqrt(s / m) each
    direct = RdpAccountant(list(rdp_orders()), dp_accounting.NeighboringRelation.REPLACE_ONE)
    for held in (4, 2, 1):
        direct.compose(dp_accounting.GaussianDpEvent(3.0 * np.sqrt(held / 4) / 2))
    assert privacy.epsilon_fleet() == pytest.approx(direct.get_epsilon(privacy.delta), rel=1e-9)
    assert privacy.epsilon_fleet() > local_epsilon("fixed", 3.0, 3, privacy.delta)
    restored = RunPrivacy(settings, devices=4, population=4, fraction=1.0, rounds=3, evaluations=0, seed=0)
    restored.restore(privacy.to_state())
    assert restored.epsilon_fleet() == privacy.epsilon_fleet()


def test_under_distributed_dp_each_device_noises_its_accuracy_and_the_coordinator_adds_none():
    # Prepare: a device's reproducible generator, so its draw can be repeated here
    device = UploadPrivacy("distributed", clip=0.1, noise=2.0, evaluation="private", eval_noise=10.0,
                           reproducible=True, seed=0)
    privacy = RunPrivacy(PrivacySettings(dp="distributed", dp_noise=2.0, dp_eval_noise=10.0), devices=4,
                         population=4, fraction=1.0, rounds=1, evaluations=1, seed=0)

    # Execute
    reported = private_metrics({"accuracy": 0.75, "loss": 0.3}, device, device.generator("dev0", 1, "evaluation"))
    released = privacy.release_accuracy([reported["accuracy"], 0.5], 1)

    # Assert: the device's own N(0, 10^2) on its accuracy alone; the released mean is theirs, as sent,
    # and the release is accounted as one Gaussian mechanism of multiplier 10 on each device's report
    draw = device.generator("dev0", 1, "evaluation").normal(0.0, 10.0)
    assert reported == {"accuracy": pytest.approx(0.75 + draw)}
    assert released == pytest.approx((0.75 + draw + 0.5) / 2)
    assert privacy.accountant.evaluations == 1
    assert privacy.epsilon_fleet() == pytest.approx(local_epsilon("fixed", 2.0, 0, privacy.delta, evaluations=1,
                                                                  eval_noise=10.0))


def test_a_distributed_run_releases_the_mean_of_the_accuracies_its_devices_noised(federation):
    # Prepare: private evaluation; a spy on what the devices report
    coordinator = federation.coordinator(distributed_config(federation, dp_evaluation="private"))
    reports = federation.spy(Kind.EVAL_RES)
    for i, keys in enumerate(fleet_keys(DEVICES)):
        federation.start_device(i, DEVICES, secagg_keys=keys)

    # Execute
    report = coordinator.run()

    # Assert: each device sent its accuracy alone, noised (N(0, 10^2): outside [0, 1] but for a
    # 4 % chance each); the coordinator released their mean as sent and accounted the release
    sent = [envelope.metrics for envelope in drain(reports)]
    assert len(sent) == DEVICES and all(set(metrics) == {"accuracy"} for metrics in sent)
    accuracies = [metrics["accuracy"] for metrics in sent]
    assert any(not 0.0 <= accuracy <= 1.0 for accuracy in accuracies)
    assert report["privacy"]["released_accuracy"] == pytest.approx(np.mean(accuracies), rel=1e-12)
    assert report["privacy"]["evaluations_accounted"] == 1
    expected = local_epsilon("fixed", NOISE, 1, DELTA, evaluations=1, eval_noise=10.0)
    assert report["privacy"]["epsilon_fleet"] == pytest.approx(expected, rel=1e-9)


def test_the_summary_gives_a_distributed_runs_epsilon_against_the_coordinator_and_its_randomness():
    from coordinator.run.report_files import privacy_line

    privacy = {"mode": "distributed", "epsilon": 1.5, "epsilon_fleet": 12.25, "delta": 1e-5, "noise_multiplier": 2.0,
               "clip": 0.1, "budget": None, "outside_the_guarantee": [], "randomness": "the run's seed"}

    line = privacy_line(privacy)

    assert "against the coordinator and the other devices (who see the selections) 12.2" in line
    assert "drawn from the run's seed" in line
    assert "seed" not in privacy_line({**privacy, "randomness": "operating system entropy"})
