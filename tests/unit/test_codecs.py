"""Upload codecs: round trips within their precision, the bytes they save, malformed input."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk import codecs, wire
from edge_sdk.protocol import ArrayGroup, Envelope, Kind, ValidationError

SPEC = {"shared": {"w": ((64, 32), "float32"), "n": ((3,), "int64")}}


def arrays(seed: int):
    rng = np.random.default_rng(seed)
    down: dict[str, ArrayGroup] = {"shared": {"w": rng.normal(0, 1, (64, 32)).astype(np.float32), "n": np.arange(3)}}
    up = {"shared": {"w": down["shared"]["w"] + rng.normal(0, 0.01, (64, 32)).astype(np.float32),
                     "n": np.arange(3)}}
    return down, up


@pytest.mark.parametrize("codec, tolerance", [("fp32", 0.0), ("fp16", 1e-5), ("int8", 2e-4)])
def test_round_trip_recovers_the_update_within_the_codec_precision(codec, tolerance):
    down, up = arrays(0)

    decoded = codecs.decode(codec, codecs.encode(codec, up, down), down, SPEC)

    assert decoded["shared"]["w"].dtype == np.float32
    np.testing.assert_allclose(decoded["shared"]["w"], up["shared"]["w"], atol=tolerance)
    np.testing.assert_array_equal(decoded["shared"]["n"], up["shared"]["n"])


def test_codecs_shrink_the_encoded_upload():
    down, up = arrays(1)

    sizes = {c: len(wire.encode(Envelope(Kind.TRAIN_RES, "d", groups=codecs.encode(
        c, up, down, rng=np.random.default_rng(0))))) for c in codecs.CODECS}

    assert sizes["fp16"] < 0.55 * sizes["fp32"]
    assert sizes["int8"] < 0.3 * sizes["fp32"]
    assert sizes["q4"] < 0.16 * sizes["fp32"]
    assert sizes["q2"] < 0.1 * sizes["fp32"]
    assert sizes["topk"] < 0.1 * sizes["fp32"]


def test_int8_without_its_scale_is_rejected():
    down, up = arrays(2)
    encoded = codecs.encode("int8", up, down)
    del encoded["shared"]["w#scale"]

    with pytest.raises(ValidationError):
        codecs.decode("int8", encoded, down, SPEC)


def test_unknown_codec_is_named():
    with pytest.raises(ValueError, match="int4"):
        codecs.encode("int4", {}, {})


def test_int8_rounds_half_to_even_with_the_scale_of_the_documented_arithmetic():
    # Prepare: changes whose quotient by the scale (127 / 127 = 1.0) lies exactly half-way
    down = {"g": {"w": np.zeros(6, np.float32)}}
    up = {"g": {"w": np.array([127.0, 0.5, 1.5, 2.5, -0.5, -2.5], np.float32)}}

    # Execute
    sent = codecs.encode("int8", up, down)["g"]

    # Assert: docs/PROTOCOL.md section 8, round half to even (not half away from zero)
    assert sent["w"].dtype == np.int8 and sent["w#scale"].dtype == np.float32 and sent["w#scale"].shape == ()
    assert sent["w"].tolist() == [127, 0, 2, 2, 0, -2]
    assert sent["w#scale"] == np.float32(1.0)


@pytest.mark.parametrize("seed", range(5))
def test_int8_bytes_follow_the_documented_steps(seed):
    # Prepare: what another implementation computes from docs/PROTOCOL.md section 8
    rng = np.random.default_rng(seed)
    broadcast = rng.normal(0, 1, 500).astype(np.float32)
    update = broadcast + (rng.normal(0, 1, 500) * 10.0 ** rng.uniform(-4, 1)).astype(np.float32)
    change = update - broadcast  # step 1, float32
    scale = np.float32(float(np.abs(change).max()) / 127.0)  # steps 2-3: float64 division, one rounding
    quotient = change / scale  # step 4: float32 division
    assert quotient.dtype == np.float32
    expected = np.clip(np.rint(quotient), -127, 127).astype(np.int8)

    # Execute
    sent = codecs.encode("int8", {"g": {"w": update}}, {"g": {"w": broadcast}})["g"]

    # Assert: the same bytes
    assert sent["w"].tobytes() == expected.tobytes()
    assert sent["w#scale"].tobytes() == np.array(scale, np.float32).tobytes()


@pytest.mark.parametrize("codec", ["fp16", "int8", "topk", "q4", "q2"])
def test_a_lossy_codec_is_refused_at_start_for_an_algorithm_that_cannot_take_one(codec):
    from coordinator import algorithms
    from coordinator.aggregation.validation import check_upload_codec
    from edge_sdk.config import ConfigError

    check_upload_codec(codec, algorithms.load("fedavg"))
    check_upload_codec("fp32", algorithms.load("dc_pfl"))
    with pytest.raises(ConfigError, match=rf"^upload_codec: dc_pfl cannot take {codec}: its class covariances"):
        check_upload_codec(codec, algorithms.load("dc_pfl"))


# -- topk, q4, q2 -------------------------------------------------------------------------------


def test_q4_and_q2_round_trip_within_one_step_of_their_block_scale():
    down, up = arrays(3)
    change = up["shared"]["w"] - down["shared"]["w"]

    for codec, levels in (("q4", 7), ("q2", 1)):
        encoded = codecs.encode(codec, up, down, rng=np.random.default_rng(1))
        decoded = codecs.decode(codec, encoded, down, SPEC)["shared"]["w"] - down["shared"]["w"]

        step = np.repeat(encoded["shared"]["w#scale"] / levels, 256).reshape(change.shape)
        assert encoded["shared"]["w"].dtype == np.uint8
        assert encoded["shared"]["w"].size == change.size // (2 if codec == "q4" else 4)
        assert np.all(np.abs(decoded - change) <= step * 1.0001 + 1e-7), codec


@pytest.mark.parametrize("codec", ["q4", "q2"])
def test_stochastic_quantization_is_unbiased(codec):
    # Prepare: one change, many independent roundings
    down, up = arrays(4)
    change = (up["shared"]["w"] - down["shared"]["w"]).astype(np.float64)

    # Execute
    mean = np.mean([codecs.decode(codec, codecs.encode(codec, up, down, rng=np.random.default_rng(seed)), down,
                                  SPEC)["shared"]["w"] - down["shared"]["w"] for seed in range(400)], axis=0)

    # Assert: the mean of 400 draws is within 5 standard errors of the change (a step is at most max|x| / L)
    step = np.abs(change).max() / (7 if codec == "q4" else 1)
    assert np.all(np.abs(mean - change) < 5 * step / 2 / np.sqrt(400))
    assert abs(float(np.mean(mean - change))) < step / 400


def test_the_rounding_generator_is_reproducible_and_differs_between_devices():
    draw = [codecs.rounding_generator(3, 2, device).random() for device in ("a", "a", "b")]

    assert draw[0] == draw[1] != draw[2]


def test_q4_packs_two_codes_per_byte_low_nibble_first():
    # Prepare: a block whose scale is 7, so every value is exactly a level (no rounding)
    up = {"g": {"w": np.array([7, -7, 0, 3, -1], np.float32)}}
    down = {"g": {"w": np.zeros(5, np.float32)}}

    sent = codecs.encode("q4", up, down, rng=np.random.default_rng(0))["g"]

    # Assert: codes level + 7 = 14, 0, 7, 10, 6, and the padding slot the zero level's code 7
    assert sent["w"].tolist() == [14 | 0 << 4, 7 | 10 << 4, 6 | 7 << 4]
    assert sent["w#scale"].tolist() == [7.0]


def test_q2_packs_four_codes_per_byte_low_bits_first():
    up = {"g": {"w": np.array([1, -1, 0, 1, -1], np.float32)}}
    down = {"g": {"w": np.zeros(5, np.float32)}}

    sent = codecs.encode("q2", up, down, rng=np.random.default_rng(0))["g"]

    assert sent["w"].tolist() == [2 | 0 << 2 | 1 << 4 | 2 << 6, 0 | 1 << 2 | 1 << 4 | 1 << 6]


def test_topk_sends_the_largest_entries_sorted_and_decodes_them():
    down = {"g": {"w": np.zeros((2, 50), np.float32)}}
    change = np.zeros(100, np.float32)
    change[[3, 97, 40]] = [5.0, -9.0, 2.0]
    up = {"g": {"w": change.reshape(2, 50)}}
    codec = codecs.UploadCodec("topk", 0.02)

    sent = codecs.encode(codec, up, down)["g"]
    decoded = codecs.decode(codec, {"g": sent}, down, {"g": {"w": ((2, 50), "float32")}})["g"]["w"]

    assert sent["w#index"].dtype == np.int32 and sent["w#index"].tolist() == [3, 97]
    assert sent["w"].dtype == np.float32 and sent["w"].tolist() == [5.0, -9.0]
    expected = np.zeros(100, np.float32)
    expected[[3, 97]] = [5.0, -9.0]
    np.testing.assert_array_equal(decoded.reshape(-1), expected)


def test_topk_breaks_ties_towards_the_lower_index():
    index = codecs.sparse_codec.largest(np.array([1.0, -2.0, 2.0, 2.0, 0.5], np.float32), 2)

    assert index.tolist() == [1, 2]


def test_error_feedback_loses_nothing_sent_plus_residual_is_the_sum_of_changes():
    # Prepare: five rounds of changes of one array, with the device's residuals
    rng = np.random.default_rng(5)
    down = {"g": {"w": np.zeros((40, 10), np.float32)}}
    residuals = codecs.Residuals()
    codec = codecs.UploadCodec("topk", 0.05)
    sent_total = np.zeros((40, 10), np.float64)
    change_total = np.zeros((40, 10), np.float64)

    # Execute
    for _ in range(5):
        change = rng.normal(0, 1, (40, 10)).astype(np.float32)
        change_total += change
        encoded = codecs.encode(codec, {"g": {"w": change}}, down, residuals=residuals)
        sent_total += codecs.decode(codec, encoded, down, {"g": {"w": ((40, 10), "float32")}})["g"]["w"]
        assert encoded["g"]["w"].size == 20

    # Assert
    residual = residuals.arrays["g", "w"]
    np.testing.assert_allclose(sent_total + residual, change_total, atol=1e-5)


def test_residuals_survive_the_personal_state_and_reset_on_a_new_shape():
    residuals = codecs.Residuals()
    residuals.keep("body", "conv.w", np.ones(3, np.float32))
    personal, saved = codecs.Residuals.split({"head.w": np.zeros(2), **residuals.to_arrays()})
    restored = codecs.Residuals(saved)

    assert list(personal) == ["head.w"]
    np.testing.assert_array_equal(restored.fed_back("body", "conv.w", np.zeros(3, np.float32)), np.ones(3))
    restored.keep("body", "conv.w", np.ones(3, np.float32))
    np.testing.assert_array_equal(restored.fed_back("body", "conv.w", np.zeros(4, np.float32)), np.zeros(4))
    restored.keep("body", "conv.w", np.array([np.nan], np.float32))
    assert restored.arrays == {}


def test_arrays_that_did_not_come_down_travel_unchanged_under_the_change_codecs():
    up: dict[str, ArrayGroup] = {"g": {"new": np.arange(4, dtype=np.float32), "n": np.arange(3)}}

    for codec in ("topk", "q4", "q2"):
        sent = codecs.encode(codec, up, {}, rng=np.random.default_rng(0))
        decoded = codecs.decode(codec, sent, {}, {"g": {"new": ((4,), "float32"), "n": ((3,), "int64")}})

        assert set(sent["g"]) == {"new", "n"}
        np.testing.assert_array_equal(decoded["g"]["new"], up["g"]["new"])


def _q4(seed: int = 6) -> tuple[dict, dict]:
    down, up = arrays(seed)
    return down, codecs.encode("q4", up, down, rng=np.random.default_rng(0))


def _topk(seed: int = 7) -> tuple[dict, dict]:
    down, up = arrays(seed)
    return down, codecs.encode(codecs.UploadCodec("topk", 0.01), up, down)


def _set(encoded: dict, key: str, value) -> dict:
    encoded["shared"][key] = value
    return encoded


def _without(encoded: dict, key: str) -> dict:
    del encoded["shared"][key]
    return encoded


REFUSALS = {
    "q4 codes of the wrong length": ("q4", lambda e: _set(e, "w", e["shared"]["w"][:-1]), "malformed", "codes"),
    "q4 codes not uint8": ("q4", lambda e: _set(e, "w", e["shared"]["w"].astype(np.int8)), "malformed", "codes"),
    "q4 scales of the wrong length": ("q4", lambda e: _set(e, "w#scale", e["shared"]["w#scale"][:-1]), "malformed",
                                      "scales"),
    "q4 negative scale": ("q4", lambda e: _set(e, "w#scale", -e["shared"]["w#scale"]), "malformed", "non-negative"),
    "q4 infinite scale": ("q4", lambda e: _set(e, "w#scale", np.full_like(e["shared"]["w#scale"], np.inf)),
                          "malformed", "finite"),
    "q4 code 15": ("q4", lambda e: _set(e, "w", np.full_like(e["shared"]["w"], 0xFF)), "malformed", "code above"),
    "q4 without scales": ("q4", lambda e: _without(e, "w#scale"), "malformed", "w#scale"),
    "topk without index": ("topk", lambda e: _without(e, "w#index"), "malformed", "int32"),
    "topk int64 index": ("topk", lambda e: _set(e, "w#index", e["shared"]["w#index"].astype(np.int64)), "malformed",
                         "int32"),
    "topk too many entries": ("topk", lambda e: _set(_set(e, "w#index", np.arange(30, dtype=np.int32)), "w",
                                                     np.ones(30, np.float32)), "malformed", "at most 21"),
    "topk unsorted": ("topk", lambda e: _set(e, "w#index", e["shared"]["w#index"][::-1].copy()), "malformed",
                      "increasing"),
    "topk repeated": ("topk", lambda e: _set(e, "w#index", np.repeat(e["shared"]["w#index"][:1], 21)), "malformed",
                      "increasing"),
    "topk out of range": ("topk", lambda e: _set(e, "w#index", e["shared"]["w#index"] + 2048), "malformed",
                          "out of range"),
    "topk negative index": ("topk", lambda e: _set(e, "w#index", e["shared"]["w#index"] - 5000), "malformed",
                            "out of range"),
    "topk counts differ": ("topk", lambda e: _set(e, "w", e["shared"]["w"][:-1]), "malformed", "values for"),
    "topk float16 values": ("topk", lambda e: _set(e, "w", e["shared"]["w"].astype(np.float16)), "bad_dtype",
                            "float32"),
    "topk index of nothing": ("topk", lambda e: _set(e, "x#index", np.zeros(1, np.int32)), "unexpected_arrays",
                              "x#index"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_malformed_topk_and_q4_uploads_are_refused_by_name(case):
    # Prepare
    codec_name, corrupt, reason, detail = REFUSALS[case]
    down, encoded = _q4() if codec_name == "q4" else _topk()
    codec = codecs.UploadCodec(codec_name, 0.01)

    # Execute, Assert: the reason code, and a detail naming the group and array
    with pytest.raises(ValidationError) as refused:
        codecs.decode(codec, corrupt(encoded), down, SPEC)
    assert refused.value.reason.value == reason
    assert "shared/" in refused.value.detail and detail in refused.value.detail


def test_q_codecs_need_a_rounding_generator():
    down, up = arrays(8)

    with pytest.raises(ValueError, match="rng"):
        codecs.encode("q4", up, down)


def test_topk_fraction_is_checked_by_name_and_announced_only_when_set():
    from coordinator.config.run_config import RunConfig
    from edge_sdk.settings import TrainSettings

    with pytest.raises(ValueError, match="topk_fraction"):
        TrainSettings(topk_fraction=0.1)  # without upload_codec topk
    with pytest.raises(ValueError, match="topk_fraction"):
        TrainSettings(upload_codec="topk", topk_fraction=0.0)
    announced = RunConfig.of(algorithm="fedavg", dataset="digits", upload_codec="topk",
                             topk_fraction=0.05).welcome_settings()
    default = RunConfig.of(algorithm="fedavg", dataset="digits", upload_codec="topk").welcome_settings()

    assert announced["topk_fraction"] == 0.05 and "topk_fraction" not in default
    assert codecs.UploadCodec.of(TrainSettings(upload_codec="topk", topk_fraction=0.05)).topk_fraction == 0.05
