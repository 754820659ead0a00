"""Unit tests for edge_sdk.params: the shared/personal partition by part and array checks."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.params import ArraySpec, Partition, check_arrays, nbytes, part_of, partition_by_parts, spec_of
from edge_sdk.protocol import Reason, ValidationError

KEYS = [
    "body.0.weight",
    "body.1.weight",
    "body.1.bias",
    "body.1.running_mean",
    "body.1.running_var",
    "body.1.num_batches_tracked",
    "bodyguard.weight",  # shares a prefix with "body", but is another part
    "head.weight",
    "head.bias",
]
STATS = {"body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"}


def test_part_of_is_the_first_dotted_segment():
    assert part_of("body.conv1.weight") == "body"
    assert part_of("head") == "head"
    assert part_of("bodyguard.weight") == "bodyguard"


def test_partition_shares_the_parts_except_statistics():
    # Execute
    partition = partition_by_parts(KEYS, ["body"], STATS)

    # Assert: order of the keys is kept; statistics and other parts stay personal
    assert partition.shared == ("body.0.weight", "body.1.weight", "body.1.bias")
    assert partition.personal == (
        "body.1.running_mean",
        "body.1.running_var",
        "body.1.num_batches_tracked",
        "bodyguard.weight",
        "head.weight",
        "head.bias",
    )


def test_partition_of_all_parts_without_statistics_shares_everything():
    partition = partition_by_parts(KEYS, ["body", "bodyguard", "head"])
    assert partition.shared == tuple(KEYS) and partition.personal == ()


def test_partition_split_returns_the_two_groups():
    # Prepare
    state = {k: np.full(2, i, dtype=np.float32) for i, k in enumerate(["body.w", "head.w", "body.running_mean"])}
    partition = partition_by_parts(state, ["body"], {"body.running_mean"})

    # Execute
    shared, personal = partition.split(state)

    # Assert
    assert list(shared) == ["body.w"] and list(personal) == ["head.w", "body.running_mean"]
    assert shared["body.w"] is state["body.w"]
    assert partition == Partition(("body.w",), ("head.w", "body.running_mean"))


# -- check_arrays --------------------------------------------------------------------------

SPEC = {"w": ((2, 3), "float32"), "n": ((), "int64")}


def _good() -> dict[str, np.ndarray]:
    return {"w": np.zeros((2, 3), np.float32), "n": np.array(4, np.int64)}


def _reason(arrays) -> Reason:
    with pytest.raises(ValidationError) as info:
        check_arrays("shared", arrays, SPEC)
    return info.value.reason


def test_check_arrays_accepts_exact_spec():
    check_arrays("shared", _good(), SPEC)  # does not raise
    assert spec_of(_good()) == SPEC


def test_missing_array_is_unexpected():
    arrays = _good()
    del arrays["n"]
    assert _reason(arrays) is Reason.UNEXPECTED_ARRAYS


def test_extra_array_is_unexpected_and_named():
    # Prepare
    arrays = {**_good(), "body.1.running_mean": np.zeros(3, np.float32)}

    # Execute / Assert
    with pytest.raises(ValidationError) as info:
        check_arrays("shared", arrays, SPEC)
    assert info.value.reason is Reason.UNEXPECTED_ARRAYS
    assert "body.1.running_mean" in str(info.value)


@pytest.mark.parametrize(
    "key, array",
    [("w", np.zeros((3, 2), np.float32)), ("w", np.zeros(6, np.float32)), ("n", np.array([4], np.int64))],
    ids=["transposed", "flat", "1-d"],
)
def test_wrong_shape_is_bad_shape(key, array):
    arrays = {**_good(), key: array}
    assert _reason(arrays) is Reason.BAD_SHAPE


@pytest.mark.parametrize(
    "key, array",
    [("w", np.zeros((2, 3), np.float64)), ("w", np.zeros((2, 3), np.float16)), ("n", np.array(4, np.int32))],
    ids=["float64", "float16", "int32"],
)
def test_wrong_dtype_is_rejected(key, array):
    arrays = {**_good(), key: array}
    assert _reason(arrays) is Reason.BAD_DTYPE


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_rejected(value):
    # Prepare
    arrays = _good()
    arrays["w"] = arrays["w"].copy()
    arrays["w"][1, 2] = value

    # Execute / Assert
    assert _reason(arrays) is Reason.NON_FINITE


def test_float16_inf_is_non_finite():
    # Prepare
    spec: ArraySpec = {"h": ((2,), "float16")}
    arrays = {"h": np.array([65504.0, np.inf], dtype=np.float16)}

    # Execute / Assert
    with pytest.raises(ValidationError) as info:
        check_arrays("g", arrays, spec)
    assert info.value.reason is Reason.NON_FINITE


def test_nbytes_sums_the_arrays():
    assert nbytes(_good()) == 2 * 3 * 4 + 8
