"""The coordinator's fast per-update path rejects and folds exactly as the plain one did.

`all_finite` settles float32 blocks by a sum of squares, `check_update` bounds the norm in
float32 before computing it in float64, and `WeightedMean` takes each change straight into its
scratch block. The plain versions, written out below as they were, are the oracle: the same
reason for every rejected update (NaN and infinities at every position of a block, the last
block's tail included, wrong dtypes and shapes, norms over, at and just under the bound) and
bit-identical sums in float32 and float64 mode.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from coordinator.aggregation.averaging import (
    SQUARED_CHANGE_MARGIN,
    WeightedMean,
    squared_change_above,
    squared_distance,
)
from coordinator.aggregation.validation import UpdateLimits, check_update, delta_norm, norm_over
from edge_sdk import codecs
from edge_sdk.params import BLOCK, aligned_reference, all_finite, blocks, flat, spec_of
from edge_sdk.protocol import Envelope, Kind, Reason, ValidationError

# -- the plain path, as it was: the oracle ------------------------------------------------


def plain_reason(envelope: Envelope, spec: dict, reference: dict, limits: UpdateLimits) -> Reason | None:
    """check_update with np.isfinite on every block and the float64 norm of every update."""
    if set(envelope.groups) != set(spec):
        return Reason.UNEXPECTED_ARRAYS
    for group, expected in spec.items():
        arrays = envelope.groups[group]
        if set(arrays) != set(expected):
            return Reason.UNEXPECTED_ARRAYS
        for key, array in arrays.items():
            shape, dtype = expected[key]
            if array.dtype.name != dtype:
                return Reason.BAD_DTYPE
            if tuple(array.shape) != tuple(shape):
                return Reason.BAD_SHAPE
            values = flat(array)
            if array.dtype.kind == "f" and not all(np.isfinite(values[p]).all() for p in blocks(values.size)):
                return Reason.NON_FINITE
    claimed = envelope.metrics.get("num_examples")
    if not isinstance(claimed, (int, float)) or not claimed >= 1:
        return Reason.MALFORMED
    if limits.max_update_norm > 0 and delta_norm(envelope.groups, reference) > limits.max_update_norm:
        return Reason.NORM_TOO_LARGE
    return None


def plain_fold(total: np.ndarray, value: np.ndarray, reference: np.ndarray | None, weight: float) -> None:
    """WeightedMean._fold as it was: copy, subtract, scale, add, a block at a time."""
    flat_total, flat_value, flat_reference = total.reshape(-1), flat(value), flat(reference)
    scratch = np.empty(BLOCK, total.dtype)
    for part in blocks(flat_total.size):
        step = scratch[: part.stop - part.start]
        step[...] = flat_value[part]
        if flat_reference is not None:
            step -= flat_reference[part]
        step *= weight
        flat_total[part] += step


class PlainMean(WeightedMean):
    def _fold(self, total, value, reference, weight) -> None:
        plain_fold(total, value, reference, weight)


# -- helpers --------------------------------------------------------------------------------

SIZES = {"a": (3, 5), "big": (2 * BLOCK + 77,), "c": (7,)}
"""`big` spans two full blocks and a short tail."""


def reference_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(shape, dtype=np.float32) for k, shape in SIZES.items()}


def update_of(reference: dict[str, np.ndarray], seed: int = 1, scale: float = 0.01) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: v + np.float32(scale) * rng.standard_normal(v.shape, dtype=np.float32) for k, v in reference.items()}


def envelope(arrays: dict[str, np.ndarray], examples: int = 10) -> Envelope:
    return Envelope(Kind.TRAIN_RES, "dev0", run_id="r", round=1, groups={"shared": arrays},
                    metrics={"num_examples": examples})


def reason_of(update: Envelope, spec: dict, reference: dict, limits: UpdateLimits) -> Reason | None:
    try:
        check_update(update, spec, reference, 100, limits)
    except ValidationError as err:
        return err.reason
    return None


def assert_same_verdict(update: Envelope, reference: dict[str, np.ndarray], bound: float) -> Reason | None:
    spec, sent, limits = {"shared": spec_of(reference)}, {"shared": reference}, UpdateLimits(1000, bound)
    expected = plain_reason(update, spec, sent, limits)
    assert reason_of(update, spec, sent, limits) is expected
    return expected


def positions(size: int) -> list[int]:
    """First, last, and both sides of every block boundary."""
    edges = {0, size - 1}
    for start in range(BLOCK, size, BLOCK):
        edges |= {start - 1, start}
    return sorted(p for p in edges if 0 <= p < size)


# -- non-finite values ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("bound", [0.0, 1e6])
def test_a_non_finite_value_anywhere_is_rejected_as_before(bad, bound):
    # Prepare
    reference = reference_state()
    for key, shape in SIZES.items():
        for position in positions(math.prod(shape)):
            arrays = update_of(reference)
            arrays[key].reshape(-1)[position] = bad

            # Execute / Assert
            assert assert_same_verdict(envelope(arrays), reference, bound) is Reason.NON_FINITE, (key, position)


@pytest.mark.parametrize("size", [1, 2, 15, 16, 17, 33, 1000, BLOCK - 1, BLOCK, BLOCK + 1])
def test_all_finite_finds_a_nan_in_every_position_of_short_arrays_and_block_tails(size):
    # Prepare
    values = np.ones(size, np.float32)
    tail = range(size) if size <= 40 else [*range(17), *range(size - 17, size)]

    for position in tail:
        values[position] = np.nan

        # Execute / Assert
        assert not all_finite(values), position
        values[position] = 1.0
    assert all_finite(values)


def misaligned(values: np.ndarray, offset: int = 3) -> np.ndarray:
    """A read-only copy of `values` starting `offset` bytes into a buffer, as wire.decode makes them."""
    raw = bytearray(values.nbytes + offset)
    raw[offset:] = values.tobytes()
    return np.frombuffer(bytes(raw), values.dtype, offset=offset).reshape(values.shape)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_misaligned_arrays_from_a_message_are_checked_in_every_position(bad):
    # Prepare
    size = 2 * BLOCK + 5
    for position in positions(size):
        values = np.ones(size, np.float32)
        values[position] = bad

        # Execute
        view = misaligned(values)

        # Assert
        assert not view.flags.aligned and not all_finite(view), position
    assert all_finite(misaligned(np.ones(size, np.float32)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_large_finite_values_whose_squares_overflow_are_finite(dtype):
    # Prepare: float32's squares of 3e38 overflow to inf, the values do not
    big = np.full(BLOCK + 3, np.finfo(dtype).max, dtype)

    # Execute / Assert
    assert all_finite(big)
    big[-1] = np.inf
    assert not all_finite(big)


def test_huge_finite_updates_pass_the_finite_check_and_fail_the_norm_as_before():
    # Prepare
    reference = reference_state()
    arrays = update_of(reference)
    arrays["big"][BLOCK + 5] = np.float32(3e38)
    arrays["big"][BLOCK + 6] = np.float32(-3e38)

    # Execute / Assert: the float32 bound overflows, the float64 norm decides
    assert assert_same_verdict(envelope(arrays), reference, 1e6) is Reason.NORM_TOO_LARGE
    assert assert_same_verdict(envelope(arrays), reference, 0.0) is None


def test_a_non_finite_reference_leaves_the_decision_to_the_float64_norm():
    # Prepare: the plain path computed a NaN norm, which is not over any bound
    reference = reference_state()
    arrays = update_of(reference)
    reference["a"][1, 2] = np.nan
    reference["c"][0] = np.inf

    # Execute / Assert
    assert assert_same_verdict(envelope(arrays), reference, 1e6) is None


# -- wrong layout, and which reason wins ----------------------------------------------------


def test_wrong_dtype_shape_and_names_give_the_same_reasons():
    reference = reference_state()
    cases = []
    for key in SIZES:
        arrays = update_of(reference)
        arrays[key] = arrays[key].astype(np.float64)
        cases.append((arrays, Reason.BAD_DTYPE))
        arrays = update_of(reference)
        arrays[key] = arrays[key].reshape(-1)[:-1]
        cases.append((arrays, Reason.BAD_SHAPE))
    arrays = update_of(reference)
    del arrays["c"]
    cases.append((arrays, Reason.UNEXPECTED_ARRAYS))

    for arrays, reason in cases:
        assert assert_same_verdict(envelope(arrays), reference, 1e6) is reason


def test_misaligned_updates_are_decided_and_folded_as_before():
    # Prepare: every array of the update misaligned, as decoded from a message
    reference = reference_state()
    arrays = {k: misaligned(v) for k, v in update_of(reference).items()}
    norm = delta_norm({"shared": arrays}, {"shared": reference})
    fast, plain = WeightedMean(reference), PlainMean(reference)

    # Execute
    verdicts = [assert_same_verdict(envelope(arrays), reference, float(b)) for b in (norm / 2, norm, 2 * norm)]
    fast.add(arrays, 3.0)
    plain.add(arrays, 3.0)

    # Assert
    assert verdicts == [Reason.NORM_TOO_LARGE, None, None]
    assert all(fast.result()[k].tobytes() == plain.result()[k].tobytes() for k in reference)


def test_the_first_failing_check_in_array_order_still_wins():
    # Prepare: a NaN in the first array, a wrong shape in the last; a bad example count
    reference = reference_state()
    arrays = update_of(reference)
    arrays["a"][0, 0] = np.nan
    arrays["c"] = arrays["c"][:3]
    first_nan = update_of(reference)
    first_nan["a"][0, 0] = np.nan

    # Execute / Assert
    assert assert_same_verdict(envelope(arrays), reference, 1e6) is Reason.NON_FINITE
    assert assert_same_verdict(envelope(first_nan, examples=0), reference, 1e6) is Reason.NON_FINITE
    too_far = envelope(update_of(reference, scale=1e3), examples=0)
    assert assert_same_verdict(too_far, reference, 1.0) is Reason.MALFORMED


# -- the norm bound --------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e15])
def test_norms_just_over_at_and_just_under_the_bound_are_decided_as_before(scale):
    # Prepare: parameters and changes of that magnitude (1e-30: squares underflow float32)
    reference = {k: v * np.float32(scale) for k, v in reference_state().items()}
    arrays = update_of(reference, scale=scale)
    norm = delta_norm({"shared": arrays}, {"shared": reference})
    bounds = [norm, np.nextafter(norm, 0), np.nextafter(norm, math.inf), norm * (1 - 1e-3), norm * (1 + 1e-3),
              norm * 0.5, norm * 2]

    # Execute / Assert
    verdicts = [assert_same_verdict(envelope(arrays), reference, float(bound)) for bound in bounds]
    assert verdicts == [None, Reason.NORM_TOO_LARGE, None, Reason.NORM_TOO_LARGE, None, Reason.NORM_TOO_LARGE, None]


def test_norm_over_returns_the_float64_norm_when_it_rejects():
    reference = {"shared": reference_state()}
    update = {"shared": update_of(reference["shared"], scale=1.0)}
    norm = delta_norm(update, reference)

    assert norm_over(update, reference, norm / 3) == norm
    assert norm_over(update, reference, norm * 3) is None


def test_squared_change_above_bounds_the_exact_sum_from_above_and_closely():
    # Prepare: changes that float32 rounds (values far apart in magnitude), and tiny ones
    rng = np.random.default_rng(3)
    scratch = np.empty(BLOCK, np.float32)
    for value, reference in [
        (rng.standard_normal(BLOCK + 9, dtype=np.float32) * 1e4, rng.standard_normal(BLOCK + 9, dtype=np.float32)),
        (np.full(100, 1e-30, np.float32), np.zeros(100, np.float32)),
        (np.full(10, 1e-44, np.float32), np.full(10, -1e-44, np.float32)),
    ]:
        exact = math.fsum(float(v) ** 2 for v in value.astype(np.float64) - reference.astype(np.float64))

        # Execute
        upper = squared_change_above(value, reference, scratch)

        # Assert: above the exact sum, and by no more than the margin and float32's own rounding of
        # the sum (either way, by the CPU's sdot kernel: 2**-25 above it on an AMD EPYC with AVX-512)
        assert exact <= upper <= exact * SQUARED_CHANGE_MARGIN * (1 + 2**-12) + value.size * 2.0**-148


def test_other_dtypes_and_sliced_references_use_the_float64_norm():
    # Prepare: a float64 array, an int array (not in the norm), a reference a leading slice bigger
    rng = np.random.default_rng(5)
    reference: dict[str, np.ndarray] = {"w": rng.standard_normal((4, 6)), "n": np.array(3, np.int64),
                                        "s": rng.standard_normal((5, 8)).astype(np.float32)}
    arrays: dict[str, np.ndarray] = {"w": reference["w"] + 0.5, "n": np.array(9, np.int64),
                                     "s": reference["s"][:3, :4] + np.float32(0.25)}
    spec = {"shared": spec_of(arrays)}
    norm = delta_norm({"shared": arrays}, {"shared": reference})

    for bound in (norm * 2, norm / 2, norm):
        limits = UpdateLimits(1000, float(bound))
        update = envelope(arrays)
        assert reason_of(update, spec, {"shared": reference}, limits) is plain_reason(
            update, spec, {"shared": reference}, limits)
    aligned = aligned_reference(reference["s"], arrays["s"])
    assert aligned is not None and aligned.shape == (3, 4)


# -- folding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["float32", "float64"])
def test_the_fold_is_bit_identical_to_the_plain_one(mode):
    # Prepare: float32 (multi-block), float16, float64, int8 and int64 arrays; a sliced and a missing reference
    rng = np.random.default_rng(11)
    reference: dict[str, np.ndarray] = {
        "f32": rng.standard_normal(2 * BLOCK + 5, dtype=np.float32),
        "f16": rng.standard_normal(300).astype(np.float16),
        "f64": rng.standard_normal(70),
        "i8": rng.integers(-100, 100, 40).astype(np.int8),
        "i64": rng.integers(-1000, 1000, 9),
        "slice": rng.standard_normal((6, 7), dtype=np.float32),
        "f32_over_f64": rng.standard_normal(50),
    }
    updates: list[tuple[dict[str, np.ndarray], float]] = []
    for seed in range(5):
        r = np.random.default_rng(100 + seed)
        updates.append(({
            "f32": reference["f32"] + r.standard_normal(2 * BLOCK + 5, dtype=np.float32),
            "f16": (reference["f16"] + r.standard_normal(300)).astype(np.float16),
            "f64": reference["f64"] * r.standard_normal(70),
            "i8": r.integers(-100, 100, 40).astype(np.int8),
            "i64": r.integers(-1000, 1000, 9),
            "slice": r.standard_normal((4, 5), dtype=np.float32),
            "f32_over_f64": r.standard_normal(50, dtype=np.float32),
            "no_reference": r.standard_normal(8, dtype=np.float32),
        }, float(r.integers(1, 500)) / 7))
    fast, plain = WeightedMean(reference, mode), PlainMean(reference, mode)

    # Execute
    for arrays, weight in updates:
        fast.add(arrays, weight)
        plain.add(arrays, weight)
    sums = {k: v.copy() for k, v in fast._sums.items()}
    plain_sums = {k: v.copy() for k, v in plain._sums.items()}
    result, plain_result = fast.result(), plain.result()

    # Assert: the running sums and the means, bit for bit
    for key in plain_sums:
        assert sums[key].dtype == plain_sums[key].dtype
        assert sums[key].tobytes() == plain_sums[key].tobytes(), key
        assert result[key].tobytes() == plain_result[key].tobytes(), key


def test_a_float32_mean_of_many_updates_is_bit_identical_in_both_modes():
    # Prepare
    reference = reference_state()
    updates = [(update_of(reference, seed), float(seed % 7 + 1)) for seed in range(12)]

    for mode in ("float32", "float64"):
        fast, plain = WeightedMean(reference, mode), PlainMean(reference, mode)

        # Execute
        for arrays, weight in updates:
            fast.add(arrays, weight)
            plain.add(arrays, weight)

        # Assert
        assert all(fast.result()[k].tobytes() == plain.result()[k].tobytes() for k in reference)


def test_checked_values_fold_as_they_were_checked():
    # Prepare: an update through check_update, then folded, against the plain squared distance
    reference = reference_state()
    arrays = update_of(reference)
    update = envelope(arrays)
    limits = UpdateLimits(1000, 1e6)

    # Execute
    weight = check_update(update, {"shared": spec_of(reference)}, {"shared": reference}, 100, limits)
    mean = WeightedMean(reference)
    mean.add(replace(update).groups["shared"], weight)

    # Assert
    assert weight == 10.0
    assert math.isclose(sum(squared_distance(arrays[k], reference[k]) for k in arrays),
                        delta_norm({"shared": arrays}, {"shared": reference}) ** 2, rel_tol=1e-12)
    np.testing.assert_array_equal(mean.result()["c"], arrays["c"])


# -- upload codecs ----------------------------------------------------------------------------


def plain_codec_value(codec: str, value: np.ndarray, scale: np.ndarray | None, base: np.ndarray | None,
                      wanted: np.dtype) -> np.ndarray:
    """codecs.decode's arithmetic as it was, one full-size temporary per step."""
    delta = value.astype(np.float32) if codec == "fp16" else value.astype(np.float32) * np.float32(scale)
    return (delta + (base.astype(np.float32) if base is not None else 0.0)).astype(wanted)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
@pytest.mark.parametrize("wanted", ["float32", "float64"])
def test_codec_decoding_gives_the_same_values_as_before(codec, wanted):
    # Prepare: a broadcast array, one with another shape (no reference), one not broadcast
    rng = np.random.default_rng(7)
    sent = {"shared": {"w": rng.standard_normal((40, 9)).astype(wanted), "s": rng.standard_normal(4).astype(wanted)}}
    changed = {"w": sent["shared"]["w"] + 0.03 * rng.standard_normal((40, 9)),
               "s": rng.standard_normal(6), "new": rng.standard_normal(5)}
    update = {"shared": {k: v.astype(wanted) for k, v in changed.items()}}
    expected = {"shared": spec_of(update["shared"])}
    encoded = codecs.encode(codec, update, sent)

    # Execute
    decoded = codecs.decode(codec, encoded, sent, expected)["shared"]

    # Assert
    arrays = encoded["shared"]
    for key in ("w", "s", "new"):
        base = sent["shared"].get(key)
        base = base if base is not None and base.shape == arrays[key].shape else None
        plain = plain_codec_value(codec, arrays[key], arrays.get(key + codecs.SCALE_SUFFIX), base, np.dtype(wanted))
        assert decoded[key].dtype == plain.dtype and decoded[key].tobytes() == plain.tobytes(), key
