"""The DP mechanisms' arithmetic: a device's upload is clipped to C (and noised under local DP),
the coordinator's aggregate is the fixed-denominator mean with noise of standard deviation
z*C/m, and a private evaluation releases a noised mean."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest

from coordinator.privacy.mechanism import PrivateMean, noised_mean
from edge_sdk.privacy.upstream import UploadPrivacy, UploadRefused, change_norm, private_metrics, privatize
from edge_sdk.protocol import ArrayGroup


def privacy(mode: str = "central", *, clip: float = 0.5, noise: float = 2.0, evaluation: str = "private",
            reproducible: bool = True) -> UploadPrivacy:
    return UploadPrivacy(mode=mode, clip=clip, noise=noise, evaluation=evaluation, eval_noise=3.0,
                         reproducible=reproducible, seed=0)


def test_a_large_change_is_scaled_to_the_clip_bound_over_every_array_together():
    received = {"shared": {"a": np.ones((2, 2), np.float32), "b": np.zeros(3, np.float32)}}
    trained = {"shared": {"a": np.full((2, 2), 4.0, np.float32), "b": np.array([4.0, 0.0, 0.0], np.float32)}}

    sent, _ = privatize(trained, received, privacy(clip=0.5), np.random.default_rng(0))

    assert change_norm(sent, received) == pytest.approx(0.5, rel=1e-6)
    norm = np.sqrt(4 * 3.0 ** 2 + 4.0 ** 2)  # the direction is kept
    np.testing.assert_allclose(sent["shared"]["a"], 1 + 3.0 * 0.5 / norm, rtol=1e-6)
    np.testing.assert_allclose(sent["shared"]["b"], [4.0 * 0.5 / norm, 0, 0], rtol=1e-6, atol=1e-7)


def test_a_small_change_goes_up_as_it_is_under_central_dp():
    received = {"shared": {"a": np.zeros(4, np.float32)}}
    trained = {"shared": {"a": np.array([0.1, 0.0, 0.0, 0.0], np.float32)}}

    sent, _ = privatize(trained, received, privacy(clip=0.5), np.random.default_rng(0))

    np.testing.assert_array_equal(sent["shared"]["a"], trained["shared"]["a"])


def test_local_dp_adds_noise_of_z_times_c_to_every_coordinate():
    received = {"shared": {"a": np.zeros(200_000, np.float32)}}

    sent, _ = privatize({"shared": {"a": np.zeros(200_000, np.float32)}}, received,
                        privacy("local", clip=0.5, noise=2.0), np.random.default_rng(1))

    assert float(np.std(sent["shared"]["a"])) == pytest.approx(2.0 * 0.5, rel=0.01)


def test_integer_arrays_go_up_as_they_came_down_and_unknown_ones_are_refused():
    received: dict[str, ArrayGroup] = {"shared": {"bn.num_batches_tracked": np.array(7, np.int64),
                                                  "w": np.zeros(2, np.float32)}}
    trained: dict[str, ArrayGroup] = {"shared": {"bn.num_batches_tracked": np.array(12, np.int64),
                                                 "w": np.ones(2, np.float32)}}

    sent, _ = privatize(trained, received, privacy(), np.random.default_rng(0))

    assert int(sent["shared"]["bn.num_batches_tracked"]) == 7
    with pytest.raises(UploadRefused, match="new_counter"):
        privatize({"shared": {"new_counter": np.array(1, np.int64)}}, received, privacy(), np.random.default_rng(0))


def test_a_slice_of_what_came_down_is_clipped_against_that_slice():
    received = {"shared": {"w": np.ones((4, 3), np.float32)}}
    trained = {"shared": {"w": np.full((2, 3), 5.0, np.float32)}}  # CD2-pFed uploads leading slices

    sent, _ = privatize(trained, received, privacy(clip=0.5), np.random.default_rng(0))

    assert change_norm(sent, received) == pytest.approx(0.5, rel=1e-6)


def test_reproducible_noise_repeats_and_entropy_noise_does_not():
    seeded, entropy = privacy(reproducible=True), privacy(reproducible=False)

    same = [seeded.generator("dev1", 3, "upload").normal() for _ in range(2)]
    other = [entropy.generator("dev1", 3, "upload").normal() for _ in range(2)]

    assert same[0] == same[1]
    assert other[0] != other[1]
    assert seeded.generator("dev1", 3, "upload").normal() != seeded.generator("dev2", 3, "upload").normal()


def test_private_evaluation_reports_the_accuracy_alone_noised_by_a_local_device():
    measured = {"accuracy": 0.75, "loss": 0.4, "num_test": 31}

    central = private_metrics(measured, privacy("central"), np.random.default_rng(0))
    local = private_metrics(measured, privacy("local"), np.random.default_rng(0))
    outside = private_metrics(measured, privacy("central", evaluation="outside"), np.random.default_rng(0))

    assert central == {"accuracy": 0.75}
    assert set(local) == {"accuracy"} and local["accuracy"] != 0.75
    assert outside == measured


def test_the_private_mean_divides_by_the_expected_participants_and_clips_again():
    reference = {"w": np.zeros(2, np.float32)}
    mean = PrivateMean(reference, clip=1.0, std=0.0, expected=4, rng=np.random.default_rng(0))

    mean.add({"w": np.array([3.0, 4.0], np.float32)}, weight=100.0)  # norm 5: clipped to 1, weight ignored
    mean.add({"w": np.array([0.5, 0.0], np.float32)}, weight=1.0)
    result = mean.result()

    np.testing.assert_allclose(result["w"], (np.array([0.6, 0.8]) + np.array([0.5, 0.0])) / 4, rtol=1e-6)
    assert result["w"].dtype == np.float32
    assert mean.clipped == 1


def test_the_noise_of_many_aggregates_has_standard_deviation_z_c_over_m():
    z, clip, expected, trials = 1.5, 0.2, 10, 400
    reference = {"w": np.zeros(1000, np.float32)}
    rng = np.random.default_rng(7)
    results = []
    for _ in range(trials):
        mean = PrivateMean(reference, clip=clip, std=z * clip, expected=expected, rng=rng)
        mean.add({"w": np.zeros(1000, np.float32)}, weight=1.0)
        results.append(mean.result()["w"])

    std = float(np.std(np.stack(results)))

    # 400,000 draws: the sample standard deviation is within 1% of the true one with near certainty
    assert std == pytest.approx(z * clip / expected, rel=0.01)


def test_local_dp_sums_the_noised_uploads_without_clipping_them_again():
    reference = {"w": np.zeros(2, np.float32)}
    mean = PrivateMean(reference, clip=0.0, std=0.0, expected=2, rng=np.random.default_rng(0))

    mean.add({"w": np.array([30.0, 40.0], np.float32)}, weight=1.0)

    np.testing.assert_allclose(mean.result()["w"], [15.0, 20.0])


def test_a_private_evaluation_releases_a_noised_mean():
    values = [0.5] * 100

    released = [cast(float, noised_mean(values, std=2.0, rng=np.random.default_rng(seed))) for seed in range(2000)]

    assert float(np.mean(released)) == pytest.approx(0.5, abs=0.005)
    assert float(np.std(released)) == pytest.approx(2.0 / 100, rel=0.05)
    assert noised_mean([], std=2.0, rng=np.random.default_rng(0)) is None
