"""Upload codecs: round trips within their precision, the bytes they save, malformed input."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk import codecs, wire
from edge_sdk.protocol import Envelope, Kind, ValidationError

SPEC = {"shared": {"w": ((64, 32), "float32"), "n": ((3,), "int64")}}


def arrays(seed: int):
    rng = np.random.default_rng(seed)
    down = {"shared": {"w": rng.normal(0, 1, (64, 32)).astype(np.float32), "n": np.arange(3)}}
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
