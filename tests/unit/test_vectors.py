"""The protocol's test vectors (tests/vectors/) against the Python implementation.

Each vector pairs bytes with their meaning. The implementation must encode the meaning to
exactly those bytes and decode the bytes back to the meaning, so a change of the wire format
breaks these tests; and the generator must reproduce the committed files byte for byte.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from edge_sdk import codecs, signing, wire
from edge_sdk.chunks import Reassembler, chunk_frames, chunk_from_dict
from edge_sdk.protocol import NACK_FIELDS, ChunkError, Kind, Reason, Refusal, WireError, refusal_of

VECTORS = Path(__file__).resolve().parents[1] / "vectors"


def _generator():
    spec = importlib.util.spec_from_file_location("make_vectors", VECTORS / "make_vectors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()


def _load(name: str) -> dict:
    return json.loads((VECTORS / name).read_text())


def _same_arrays(got: np.ndarray, meaning: dict) -> None:
    assert got.dtype.name == meaning["dtype"]
    assert list(got.shape) == meaning["shape"]
    assert got.reshape(-1).tolist() == meaning["values"]


def _pack_array(array: np.ndarray) -> bytes:
    pieces: list = []
    wire.pack_pieces(wire.encode_array(array), pieces)
    return b"".join(bytes(piece) for piece in pieces)


def test_regenerating_gives_the_committed_files():
    # Prepare
    built = GEN.build_vectors()
    committed = {str(p.relative_to(VECTORS)) for p in VECTORS.rglob("*")
                 if p.is_file() and p.suffix in (".json", ".bin")}

    # Assert
    assert set(built) == committed
    for name, content in built.items():
        assert (VECTORS / name).read_bytes() == content, f"{name} differs from what make_vectors.py writes"


@pytest.mark.parametrize("vector", _load("envelope.json")["vectors"], ids=lambda v: v["name"])
def test_envelopes_encode_and_decode_exactly(vector):
    # Prepare
    data = bytes.fromhex(vector["hex"])
    meaning = vector["meaning"]

    # Execute
    encoded = wire.encode(GEN.envelope_from_meaning(meaning))
    decoded = wire.decode(data)

    # Assert
    assert encoded == data
    assert GEN.envelope_meaning(decoded) == meaning


def test_the_worked_example_is_the_documented_one():
    # Prepare
    vector = next(v for v in _load("envelope.json")["vectors"] if v["name"] == "worked_example")
    data = bytes.fromhex(vector["hex"])

    # Assert: docs/PROTOCOL.md §4 shows these 271 bytes
    assert len(data) == 271
    assert data[:10] == bytes.fromhex("8aa776657273696f6e01")
    assert data[0xba:0xc2] == bytes.fromhex("0000003f000080bf")  # 0.5, -1.0 little-endian float32


@pytest.mark.parametrize("vector", _load("arrays.json")["vectors"], ids=lambda v: v["name"])
def test_arrays_encode_and_decode_exactly(vector):
    # Prepare
    data = bytes.fromhex(vector["hex"])
    meaning = vector["meaning"]

    # Execute
    encoded = _pack_array(GEN.array_from_meaning(meaning))
    decoded = wire.decode_array(vector["name"], wire.unpack(b"\x81\xa1a" + data)["a"])

    # Assert
    assert encoded == data
    _same_arrays(decoded, meaning)


def test_an_array_whose_data_is_one_byte_short_is_bad_shape():
    # Prepare
    vector = next(v for v in _load("arrays.json")["vectors"] if v["name"] == "float32_matrix")
    raw = wire.unpack(b"\x81\xa1a" + bytes.fromhex(vector["hex"]))["a"]
    raw["data"] = raw["data"][:-1]

    # Execute / Assert
    with pytest.raises(WireError) as caught:
        wire.decode_array("a", raw)
    assert caught.value.reason is Reason.BAD_SHAPE


def test_chunk_frames_are_exact_and_reassemble_to_the_payload():
    # Prepare
    manifest = _load("chunks.json")
    payload = (VECTORS / manifest["payload"]).read_bytes()
    frames = [(VECTORS / frame["file"]).read_bytes() for frame in manifest["frames"]]
    reassembler = Reassembler(max_blob_bytes=1 << 20, max_pending_bytes=1 << 21)

    # Execute
    made = chunk_frames(payload, manifest["chunk_size"])
    chunks = [chunk_from_dict(wire.unpack(frame)) for frame in frames]
    results = [reassembler.add("topic", chunk) for chunk in reversed(chunks)]  # any order is accepted

    # Assert
    assert made == frames
    assert hashlib.sha256(payload).hexdigest() == manifest["payload_sha256"] == chunks[0].blob_id
    for chunk, listed, frame in zip(chunks, manifest["frames"], frames, strict=True):
        assert (chunk.blob_id, chunk.index, chunk.count, chunk.size) == (
            listed["blob"], listed["index"], listed["count"], listed["size"])
        assert bytes(chunk.data) == payload[listed["data_offset_in_payload"]:][:listed["data_bytes"]]
        assert frame.startswith(bytes.fromhex(listed["frame_prefix_hex"]))
    assert results[:-1] == [None] * (len(chunks) - 1) and results[-1] == payload
    decoded = wire.decode(payload)
    meaning = manifest["payload_meaning"]
    assert (decoded.kind.value, decoded.msg_id, decoded.round, decoded.config) == (
        meaning["kind"], meaning["msg_id"], meaning["round"], meaning["config"])
    weights = decoded.groups["shared"]["body.weight"]
    assert np.array_equal(weights, (np.arange(weights.size) % 251 - 125.0) / 8.0)


def test_a_corrupted_frame_fails_the_checksum():
    # Prepare
    manifest = _load("chunks.json")
    frames = [bytearray((VECTORS / frame["file"]).read_bytes()) for frame in manifest["frames"]]
    frames[1][-1] ^= 0x01  # the last byte of the second slice
    reassembler = Reassembler(max_blob_bytes=1 << 20, max_pending_bytes=1 << 21)
    for frame in frames[:-1]:
        reassembler.add("topic", chunk_from_dict(wire.unpack(bytes(frame))))

    # Execute / Assert
    with pytest.raises(ChunkError) as caught:
        reassembler.add("topic", chunk_from_dict(wire.unpack(bytes(frames[-1]))))
    assert caught.value.reason is Reason.CHUNK_CHECKSUM


@pytest.mark.parametrize("index", range(6))
def test_codec_vectors_encode_exactly_and_decode_back(index):
    # Prepare
    case = _load("codecs.json")["cases"][index]
    as_groups = lambda meanings: {g: {k: GEN.array_from_meaning(v) for k, v in a.items()}  # noqa: E731
                                  for g, a in meanings.items()}
    update, received = as_groups(case["update"]), as_groups(case["received"])
    codec = codecs.UploadCodec(case["codec"], case.get("topk_fraction", codecs.DEFAULT_TOPK_FRACTION))

    # Execute
    encoded = codecs.encode(codec, update, received, rng=np.random.default_rng(0))
    spec = {g: {k: (v.shape, v.dtype.name) for k, v in a.items()} for g, a in update.items()}
    decoded = codecs.decode(codec, encoded, received, spec)
    if "decoded" in case:  # q4, q2, topk: the decoded update exactly, then the update itself is compared to it
        update = as_groups(case["decoded"])

    # Assert: exact bytes of every encoded array, and the update back within the codec's precision
    assert {g: sorted(a) for g, a in encoded.items()} == {g: sorted(a) for g, a in case["encoded"].items()}
    for group, arrays in case["encoded"].items():
        for key, meaning in arrays.items():
            assert _pack_array(encoded[group][key]) == bytes.fromhex(meaning["hex"])
            _same_arrays(encoded[group][key], meaning)
    for group, arrays in update.items():
        for key, value in arrays.items():
            tolerance = 0 if value.dtype.kind != "f" else float(np.abs(value).max()) / 127
            assert np.allclose(decoded[group][key], value, atol=tolerance, rtol=0)


def test_int8_rounds_half_to_even_with_a_float32_scale():
    # Prepare
    case = _load("codecs.json")["cases"][2]
    encoded = case["encoded"]["shared"]

    # Assert: delta [-2.5, 1.5, 0.5, 127, 2.5, -0.5], scale 127 / 127 = 1
    assert encoded["t"]["values"] == [-2, 2, 0, 127, 2, 0]
    assert encoded["t#scale"] == {**encoded["t#scale"], "dtype": "float32", "shape": [], "values": [1.0]}


def test_seal_vector_is_exact_and_verifies():
    # Prepare
    vector = _load("seals.json")
    key, body = bytes.fromhex(vector["key_hex"]), bytes.fromhex(vector["body_hex"])

    # Execute
    sealed = b"".join(bytes(piece) for piece in signing.seal(key, [body]))
    opened = signing.Verifier({"dev001": key}).open_message("dev001", bytes.fromhex(vector["sealed_hex"]))

    # Assert
    assert sealed.hex() == vector["sealed_hex"]
    assert sealed.startswith(bytes.fromhex(vector["prefix_hex"]))
    assert sealed[len(signing.SEALED_PREFIX):][:32].hex() == vector["mac_hex"]
    assert bytes(opened) == body
    assert GEN.envelope_meaning(wire.decode(body)) == vector["body_meaning"]


@pytest.mark.parametrize("case", _load("seals.json")["verification"], ids=lambda c: c["case"])
def test_seal_verification_cases(case):
    # Prepare
    vector = _load("seals.json")
    payload = bytes.fromhex(case["payload_hex"] if "payload_hex" in case else vector[case["payload"]])
    verifier = signing.Verifier({"dev001": bytes.fromhex(case["key_hex"])})

    # Execute / Assert
    if case["result"] == "bad_signature":
        with pytest.raises(WireError) as caught:
            verifier.open_message("dev001", payload)
        assert caught.value.reason is Reason.BAD_SIGNATURE
    else:
        assert bytes(verifier.open_message("dev001", payload)).hex() == vector[case["result"]]


def test_nack_vector_encodes_and_decodes_exactly():
    # Prepare
    vector = _load("nack.json")
    data = bytes.fromhex(vector["hex"])

    # Execute
    decoded = wire.decode(data)

    # Assert
    assert wire.encode(GEN.envelope_from_meaning(vector["meaning"])) == data
    assert GEN.envelope_meaning(decoded) == vector["meaning"]
    assert decoded.kind is Kind.NACK
    assert tuple(decoded.config) == NACK_FIELDS


def test_refusal_vector_encodes_and_decodes_exactly():
    # Prepare
    vector = _load("refusal.json")
    data = bytes.fromhex(vector["hex"])

    # Execute
    decoded = wire.decode(data)

    # Assert: the bytes, and what a coordinator reads of them
    assert wire.encode(GEN.envelope_from_meaning(vector["meaning"])) == data
    assert GEN.envelope_meaning(decoded) == vector["meaning"]
    assert refusal_of(decoded) == Refusal(Reason.BAD_SHAPE, "shared/body.1.num_batches_tracked: got int64[1], "
                                                             "want int64[]")


def test_the_secagg_vectors_verify_and_fix_the_graph_seed_and_graph_they_state():
    # Prepare
    from edge_sdk.secagg import Roster, neighbours
    from edge_sdk.secagg.consistency import graph_seed, survivor_set_bytes, survivors_payload
    from edge_sdk.secagg.context import RoundContext
    from edge_sdk.secagg.messages import KeyAdvertisement

    vectors = _load("secagg.json")
    roster = Roster(vectors["public_keys_hex"])
    a = vectors["announced"]
    announced = RoundContext(a["run_id"], a["round"], tuple(a["participants"]), a["threshold"], a["degree"], None,
                             a["length"])
    adverts = {v["client_id"]: KeyAdvertisement(v["client_id"], bytes.fromhex(v["c_pk_hex"]),
                                                bytes.fromhex(v["s_pk_hex"]), bytes.fromhex(v["signature_hex"]))
               for v in vectors["adverts"]}

    # Assert: the signed bytes, the signatures, the seed and its graph
    assert announced.announced_bytes().hex() == vectors["announced_ctx_hex"]
    for v, advert in zip(vectors["adverts"], adverts.values(), strict=True):
        payload = KeyAdvertisement.signed_payload(announced, advert.client_id, advert.c_public, advert.s_public)
        assert payload.hex() == v["signed_payload_hex"]
        roster.verify(advert.client_id, payload, advert.signature)
    seed = graph_seed(announced, adverts)
    assert seed.hex() == vectors["graph_seed_hex"]
    context = announced.with_graph_seed(seed)
    assert context.bytes().hex() == vectors["ctx_hex"]
    graph = neighbours(a["participants"], a["degree"], seed)
    assert {device: sorted(peers) for device, peers in graph.items()} == vectors["graph"]
    for v in vectors["survivor_signatures"]:
        payload = survivors_payload(context, v["signer"], survivor_set_bytes(vectors["survivors"]))
        assert payload.hex() == v["payload_hex"]
        roster.verify(v["signer"], payload, bytes.fromhex(v["signature_hex"]))
