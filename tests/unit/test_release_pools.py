"""The coordinator's pools of device statistics for a release: class prototypes and the global
body's BatchNorm statistics."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.releases.phase import PROTOTYPES, Pool, PrototypePool, Release, ReleasePhase, StatisticsPool
from coordinator.run.folder import RunFolder
from edge_sdk.protocol import STATISTICS, Reason, ValidationError

SHAPES = {"body.1.running_mean": (3,), "body.1.running_var": (3,), "body.1.num_batches_tracked": ()}


def device_statistics(activations: np.ndarray, batches: int = 1) -> dict[str, np.ndarray]:
    """What a device reports for activations [N, 3]: per-channel mean and variance."""
    return {"body.1.running_mean": activations.mean(0).astype(np.float32),
            "body.1.running_var": activations.var(0).astype(np.float32),
            "body.1.num_batches_tracked": np.array(batches, dtype=np.int64)}


def test_pooled_statistics_are_those_of_the_union_of_the_devices_data() -> None:
    # Prepare: two devices whose data differ in mean and spread, and in size
    rng = np.random.default_rng(0)
    first = rng.normal(0.0, 1.0, size=(300, 3))
    second = rng.normal([2.0, -1.0, 5.0], [0.5, 2.0, 1.0], size=(100, 3))
    pool = StatisticsPool(SHAPES)

    # Execute
    for data, batches in ((first, 3), (second, 7)):
        statistics = device_statistics(data, batches)
        pool.check(statistics, registered_examples=len(data))
        pool.add(statistics, registered_examples=len(data))
    pooled = pool.result()

    # Assert
    union = np.concatenate([first, second])
    np.testing.assert_allclose(pooled["body.1.running_mean"], union.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pooled["body.1.running_var"], union.var(0), rtol=1e-5)
    assert pooled["body.1.running_mean"].dtype == pooled["body.1.running_var"].dtype == np.float32
    assert int(pooled["body.1.num_batches_tracked"]) == 7
    assert pool.devices == 2


@pytest.mark.parametrize(("change", "reason"), [
    (lambda s: s.pop("body.1.running_var"), Reason.UNEXPECTED_ARRAYS),
    (lambda s: s.update({"body.2.running_mean": np.zeros(3, np.float32)}), Reason.UNEXPECTED_ARRAYS),
    (lambda s: s.update({"body.1.running_mean": np.zeros(4, np.float32)}), Reason.BAD_SHAPE),
    (lambda s: s.update({"body.1.running_mean": np.zeros(3, np.int32)}), Reason.BAD_DTYPE),
    (lambda s: s.update({"body.1.running_mean": np.array([0, np.nan, 0], np.float32)}), Reason.NON_FINITE),
    (lambda s: s.update({"body.1.running_var": np.array([1, -1, 1], np.float32)}), Reason.MALFORMED),
])
def test_bad_statistics_are_rejected_with_their_reason(change, reason) -> None:
    # Prepare
    statistics = device_statistics(np.ones((4, 3)))
    change(statistics)

    # Execute
    with pytest.raises(ValidationError) as error:
        StatisticsPool(SHAPES).check(statistics, registered_examples=4)

    # Assert
    assert error.value.reason == reason


def test_an_empty_statistics_pool_has_no_result() -> None:
    with pytest.raises(ValueError, match="no statistics"):
        StatisticsPool(SHAPES).result()


def test_prototypes_are_pooled_weighted_by_class_counts() -> None:
    # Prepare
    pool = PrototypePool(num_classes=3, dim=2)
    reports = [
        {"counts": np.array([2, 0, 1]), "means": np.array([[1, 1], [0, 0], [4, 4]], np.float32)},
        {"counts": np.array([6, 0, 1]), "means": np.array([[3, 3], [9, 9], [2, 2]], np.float32)},
    ]

    # Execute
    for report in reports:
        pool.check(report, registered_examples=10)
        pool.add(report, registered_examples=10)
    result = pool.result()

    # Assert
    np.testing.assert_array_equal(result["counts"], [8, 0, 2])
    np.testing.assert_allclose(result["means"], [[2.5, 2.5], [0.0, 0.0], [3.0, 3.0]])


def test_both_pools_answer_to_the_phase_and_group_devices_send() -> None:
    # Prepare
    pools = [StatisticsPool(SHAPES), PrototypePool(num_classes=3, dim=2)]

    # Execute
    contracts = [(p.phase, p.group, p.required, p.evaluates) for p in pools]

    # Assert: trainers send statistics instead of an evaluation; weak devices may add prototypes to theirs
    assert contracts == [(STATISTICS, STATISTICS, True, False), ("prototypes", PROTOTYPES, False, True)]
    assert all(isinstance(p, Pool) for p in pools)


def test_the_release_phase_pools_the_weak_devices_prototypes_for_the_final_evaluation(tmp_path) -> None:
    # Prepare: a gather that answers for two weak devices, one without prototypes
    shares = {"lite0": {"counts": np.array([2, 0, 1]), "means": np.array([[1, 1], [0, 0], [4, 4]], np.float32)}}
    asked: list[tuple[list[str], str]] = []

    def gather(targets: list[str], pool: Pool) -> None:
        asked.append((targets, pool.phase))
        for target in targets:
            if target in shares:
                pool.check(shares[target], registered_examples=10)
                pool.add(shares[target], registered_examples=10)

    phase = ReleasePhase(RunFolder(tmp_path), num_classes=3, gather=gather, state={}, config={}, model="cnn8",
                         run_id="r1", round_=3)
    release = Release(tmp_path / "r.onnx", b"onnx", "0" * 64, {"feature_dim": 2})

    # Execute
    groups = phase.prototypes(["lite0", "lite1"], release)
    none_pooled = phase.prototypes(["lite1"], release)
    no_lite = phase.prototypes([], release)

    # Assert
    assert asked == [(["lite0", "lite1"], "prototypes"), (["lite1"], "prototypes")]
    np.testing.assert_array_equal(groups[PROTOTYPES]["counts"], [2, 0, 1])
    np.testing.assert_allclose(groups[PROTOTYPES]["means"], shares["lite0"]["means"])
    assert none_pooled == {} and no_lite == {}
