"""Distributed DP under secure aggregation over the loopback broker: each device adds its share
N(0, z^2 C^2 / m) before masking, the unmasked mean carries the noise of z C / m per coordinate,
a round with a device lost is accounted with the noise it really holds, and what cannot be
private this way is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import checkpoint
from coordinator.privacy.accountant import PrivacyAccountant
from edge_sdk.config import ConfigError
from edge_sdk.privacy.upstream import NOISE_SHARES, UploadPrivacy
from loopback_runs import BlockingLock
from test_loopback_secagg import DEVICES, fleet_keys, start_with_the_last_lost

CLIP = 0.01
NOISE = 40.0
DELTA = 1e-9


def distributed_config(federation, **changes):
    settings = dict(clients=DEVICES, secure_aggregation=True, dp="distributed", dp_clip=CLIP, dp_noise=NOISE,
                    dp_delta=DELTA, dp_evaluation="outside", aggregation_dtype="float64", rounds=1)
    return federation.config(**{**settings, **changes})


def shared_change(federation, coordinator) -> np.ndarray:
    """The global shared state's change over the run, every floating value in one vector."""
    state = checkpoint.load(federation.folder.checkpoint).state["shared"]
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
