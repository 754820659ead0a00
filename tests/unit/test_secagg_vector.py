"""A round's shared upload as one vector: the secure sum of the devices' vectors gives the
example-weighted mean the plain protocol computes, within the stated quantization error."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.aggregation.averaging import PartialSum, WeightedMean
from edge_sdk.params import spec_of
from edge_sdk.protocol import ArrayGroup
from edge_sdk.secagg import FixedPoint
from edge_sdk.secagg.vector import VectorLayout
from secagg_rounds import AFTER_SHARE, play, round_context

SENT: dict[str, ArrayGroup] = {"shared": {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
                                          "b": np.zeros(3, dtype=np.float32), "steps": np.array(7, dtype=np.int64)}}


def update(rng: np.random.Generator, scale: float = 0.1) -> dict:
    return {"shared": {"w": (SENT["shared"]["w"] + scale * rng.standard_normal((3, 4))).astype(np.float32),
                       "b": (scale * rng.standard_normal(3)).astype(np.float32),
                       "steps": np.array(12, dtype=np.int64)}}


def test_the_layout_is_the_floating_arrays_sorted_then_the_weight():
    layout = VectorLayout({group: spec_of(arrays) for group, arrays in SENT.items()})
    assert [(slot.key, slot.start, slot.stop) for slot in layout.slots] == [("b", 0, 3), ("w", 3, 15)]
    assert layout.length == 16


def test_an_upload_is_clipped_as_one_vector_and_scaled_by_its_weight():
    layout = VectorLayout({group: spec_of(arrays) for group, arrays in SENT.items()})
    moved = update(np.random.default_rng(0), scale=5.0)
    vector = layout.encode(moved, SENT, clip=1.0, weight=0.25)
    assert np.linalg.norm(vector[:-1]) == pytest.approx(0.25)
    assert vector[-1] == 0.25
    change = np.concatenate([moved["shared"]["b"], (moved["shared"]["w"] - SENT["shared"]["w"]).ravel()])
    assert np.allclose(vector[:-1] / np.linalg.norm(vector[:-1]), change / np.linalg.norm(change))


def test_a_weight_outside_zero_to_one_is_refused():
    layout = VectorLayout({group: spec_of(arrays) for group, arrays in SENT.items()})
    with pytest.raises(ValueError, match="weight"):
        layout.encode(update(np.random.default_rng(0)), SENT, clip=1.0, weight=1.5)


def test_the_secure_sum_gives_the_plain_weighted_mean_within_the_quantization_error():
    rng = np.random.default_rng(3)
    devices, clip = 6, 10.0
    context_devices = round_context(devices, threshold=3, degree=4, length=16)
    layout = VectorLayout({group: spec_of(arrays) for group, arrays in SENT.items()})
    quantizer = FixedPoint(bound=clip, summands=devices)
    examples = {device: int(rng.integers(10, 100)) for device in context_devices.participants}
    largest = max(examples.values())
    uploads = {device: update(rng) for device in context_devices.participants}
    inputs = {device: quantizer.encode(layout.encode(uploads[device], SENT, clip, examples[device] / largest), rng)
              for device in context_devices.participants}
    dropped = context_devices.participants[0]
    trial = play(context_devices, inputs, {dropped: AFTER_SHARE})
    sums, total_weight = layout.decode(quantizer.decode_sum(trial.server.result()))

    survivors = [device for device in context_devices.participants if device != dropped]
    plain = WeightedMean(SENT["shared"], dtype="float64")
    for device in survivors:
        plain.add(uploads[device]["shared"], examples[device])
    secure = WeightedMean(SENT["shared"], dtype="float64")
    secure.add_partial(PartialSum(sums["shared"], total_weight, len(survivors)),
                       {key: value.dtype for key, value in SENT["shared"].items()})
    expected, actual = plain.result(), secure.result()
    bound = len(survivors) * quantizer.max_error_per_summand / (total_weight - len(survivors) / quantizer.scale)
    assert np.max(np.abs(actual["w"] - expected["w"])) <= 2 * bound
    assert np.max(np.abs(actual["b"] - expected["b"])) <= 2 * bound
    assert actual["steps"] == SENT["shared"]["steps"], "batch counters keep what was broadcast"
