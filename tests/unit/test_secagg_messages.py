"""Wire forms of the secagg messages: msgpack round trips, and strict rejection of malformed ones."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from edge_sdk.secagg import (EncryptedShares, KeyAdvertisement, MaskedInput, SecAggError, UnmaskRequest,
                             UnmaskResponse)
from edge_sdk.secagg.messages import SurvivorSignature

ADVERT = KeyAdvertisement("dev0", bytes(32), b"\x01" * 32, b"\x02" * 64)
SHARES = EncryptedShares("dev0", {"dev1": bytes(200), "dev2": bytes(300)})
MASKED = MaskedInput("dev0", np.arange(5, dtype=np.uint32))
REQUEST = UnmaskRequest(("dev1", "dev2"), ("dev3",), {"dev1": b"\x03" * 64})
SIGNATURE = SurvivorSignature("dev1", b"\x04" * 64)
RESPONSE = UnmaskResponse("dev0", {"dev1": bytes(66)}, {"dev3": b"\x05" * 66})


@pytest.mark.parametrize("message", [ADVERT, SHARES, REQUEST, SIGNATURE, RESPONSE])
def test_messages_survive_a_msgpack_round_trip(message):
    assert type(message).from_wire(msgpack.unpackb(msgpack.packb(message.to_wire()))) == message


def test_a_masked_vector_survives_a_msgpack_round_trip_little_endian():
    wire = msgpack.unpackb(msgpack.packb(MASKED.to_wire()))
    assert wire["vector"][:4] == b"\x00\x00\x00\x00" and wire["vector"][4:8] == b"\x01\x00\x00\x00"
    np.testing.assert_array_equal(MaskedInput.from_wire(wire).vector, MASKED.vector)


def altered(message, **fields):
    wire = message.to_wire()
    wire.update(fields)
    return wire


def without(message, field):
    wire = message.to_wire()
    del wire[field]
    return wire


@pytest.mark.parametrize(("kind", "wire", "field"), [
    (KeyAdvertisement, "not a map", "map"),
    (KeyAdvertisement, without(ADVERT, "s_pk"), "s_pk"),
    (KeyAdvertisement, altered(ADVERT, extra=1), "extra"),
    (KeyAdvertisement, altered(ADVERT, client_id=7), "client_id"),
    (KeyAdvertisement, altered(ADVERT, client_id=""), "client_id"),
    (KeyAdvertisement, altered(ADVERT, client_id="x" * 257), "client_id"),
    (KeyAdvertisement, altered(ADVERT, c_pk="00" * 32), "c_pk"),
    (KeyAdvertisement, altered(ADVERT, s_pk=bytes(31)), "s_pk"),
    (KeyAdvertisement, altered(ADVERT, signature=bytes(65)), "signature"),
    (EncryptedShares, altered(SHARES, ciphertexts=[bytes(200)]), "ciphertexts"),
    (EncryptedShares, altered(SHARES, ciphertexts={"dev1": bytes(20)}), "ciphertexts"),
    (EncryptedShares, altered(SHARES, ciphertexts={"dev1": bytes(5000)}), "ciphertexts"),
    (EncryptedShares, altered(SHARES, ciphertexts={1: bytes(200)}), "ciphertexts key"),
    (EncryptedShares, altered(SHARES, ciphertexts={"dev1": "text"}), "ciphertexts"),
    (MaskedInput, altered(MASKED, vector=bytes(7)), "vector"),
    (MaskedInput, altered(MASKED, vector=b""), "vector"),
    (MaskedInput, altered(MASKED, vector=[1, 2]), "vector"),
    (UnmaskRequest, altered(REQUEST, survivors="dev1"), "survivors"),
    (UnmaskRequest, altered(REQUEST, survivors=["dev1", 2]), "survivors"),
    (UnmaskRequest, altered(REQUEST, dropped=["dev3", "dev3"]), "dropped"),
    (UnmaskRequest, altered(REQUEST, signatures={"dev1": bytes(63)}), "signatures"),
    (UnmaskRequest, without(REQUEST, "signatures"), "signatures"),
    (SurvivorSignature, altered(SIGNATURE, signature=bytes(65)), "signature"),
    (SurvivorSignature, without(SIGNATURE, "client_id"), "client_id"),
    (UnmaskResponse, altered(RESPONSE, b_shares={"dev1": bytes(65)}), "b_shares"),
    (UnmaskResponse, altered(RESPONSE, s_shares={"dev3": 5}), "s_shares"),
    (UnmaskResponse, altered(RESPONSE, s_shares={"dev1": bytes(66)}), "both name 'dev1'"),
    (UnmaskResponse, without(RESPONSE, "client_id"), "client_id"),
])
def test_from_wire_rejects_malformed_messages_naming_the_field(kind, wire, field):
    with pytest.raises(SecAggError, match=field):
        kind.from_wire(wire)


def test_a_masked_vector_must_be_a_flat_uint32_array():
    with pytest.raises(SecAggError, match="uint32"):
        MaskedInput("dev0", np.arange(5, dtype=np.int64))
    with pytest.raises(SecAggError, match="1-D"):
        MaskedInput("dev0", np.zeros((2, 2), dtype=np.uint32))
