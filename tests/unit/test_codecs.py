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

    sizes = {c: len(wire.encode(Envelope(Kind.TRAIN_RES, "d", groups=codecs.encode(c, up, down))))
             for c in codecs.CODECS}

    assert sizes["fp16"] < 0.55 * sizes["fp32"]
    assert sizes["int8"] < 0.3 * sizes["fp32"]


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


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_a_lossy_codec_is_refused_at_start_for_an_algorithm_that_cannot_take_one(codec):
    from coordinator import algorithms
    from coordinator.aggregation.validation import check_upload_codec
    from edge_sdk.config import ConfigError

    check_upload_codec(codec, algorithms.load("fedavg"))
    check_upload_codec("fp32", algorithms.load("dc_pfl"))
    with pytest.raises(ConfigError, match=rf"^upload_codec: dc_pfl cannot take {codec}: its class covariances"):
        check_upload_codec(codec, algorithms.load("dc_pfl"))
