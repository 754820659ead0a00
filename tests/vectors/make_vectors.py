"""Write the protocol's test vectors: bytes on the wire beside what they mean.

Run `python tests/vectors/make_vectors.py` from the checkout to (re)write the files of this
folder. Everything is fixed (message ids, timestamps, keys, values), so running it again gives
identical files, and `tests/unit/test_vectors.py` checks both that the Python implementation
still encodes the meanings to exactly these bytes and decodes the bytes back to the meanings.
A device written in another language can check its own encoder and decoder against the same
files (docs/CONFORMANCE.md).

Files (JSON holds hex for short byte strings; long ones are `.bin` files named in the JSON):
- `envelope.json`: whole envelopes (the worked example of docs/PROTOCOL.md §4 among them).
- `arrays.json`: single arrays of every wire dtype, 0-d and empty ones included (section 4).
- `chunks.json` + `chunks/*.bin`: one payload cut into chunk frames, with each frame's fields (section 5).
- `codecs.json`: fp16, int8, q4, q2 and topk upload encodings of an update against the broadcast (section 8).
- `seals.json`: a message sealed with a fixed test key, and how verification goes (section 15).
- `nack.json`: a NACK a coordinator sends to a device whose reply it refused.
- `refusal.json`: a device's refusal of a TRAIN whose arrays do not fit its model (section 11).
- `secagg.json`: secure aggregation (section 19): fixed identity keys, their signed advertisements,
  the graph seed and graph they fix, and survivor signatures on a survivor set.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # run as a script from anywhere: the checkout's packages

from edge_sdk import codecs, signing, wire  # noqa: E402
from edge_sdk.chunks import MIN_CHUNK_SIZE, chunk_frames  # noqa: E402
from edge_sdk.protocol import ArrayGroup, Envelope, Kind  # noqa: E402
from edge_sdk.secagg.consistency import graph_seed, survivor_set_bytes, survivors_payload  # noqa: E402
from edge_sdk.secagg.context import RoundContext  # noqa: E402
from edge_sdk.secagg.identity import IdentityKey  # noqa: E402
from edge_sdk.secagg.messages import KeyAdvertisement  # noqa: E402

RUN_ID = "9f1c2b3a4d5e6f70"
TIMESTAMP = 1700000000.5
TEST_KEY = bytes(range(32))
"""The seals' key: bytes 00 01 ... 1f. A test key only: never enrol it."""


def msg_id(n: int) -> str:
    """A fixed 32-hex-digit message id."""
    return f"{n:032x}" if n else "0123456789abcdef0123456789abcdef"


# -- meanings <-> numpy -----------------------------------------------------------------------
def array_meaning(array: np.ndarray) -> dict[str, Any]:
    """An array as JSON: dtype, shape and its values flattened in C order."""
    values = array.reshape(-1).tolist()
    return {"dtype": array.dtype.name, "shape": list(array.shape), "values": values}


def array_from_meaning(meaning: dict[str, Any]) -> np.ndarray:
    return np.array(meaning["values"], dtype=meaning["dtype"]).reshape(meaning["shape"])


def envelope_meaning(envelope: Envelope) -> dict[str, Any]:
    return {
        "version": envelope.version, "kind": envelope.kind.value, "run_id": envelope.run_id,
        "round": envelope.round, "msg_id": envelope.msg_id, "sender": envelope.sender,
        "timestamp": envelope.timestamp,
        "groups": {group: {name: array_meaning(a) for name, a in arrays.items()}
                   for group, arrays in envelope.groups.items()},
        "metrics": dict(envelope.metrics), "config": envelope.config,
    }


def envelope_from_meaning(meaning: dict[str, Any]) -> Envelope:
    return Envelope(
        kind=Kind(meaning["kind"]), sender=meaning["sender"], run_id=meaning["run_id"], round=meaning["round"],
        msg_id=meaning["msg_id"], timestamp=meaning["timestamp"],
        groups={group: {name: array_from_meaning(a) for name, a in arrays.items()}
                for group, arrays in meaning["groups"].items()},
        metrics=dict(meaning["metrics"]), config=meaning["config"], version=meaning["version"])


# -- the vectors --------------------------------------------------------------------------------
def envelopes() -> list[dict[str, Any]]:
    worked = Envelope(Kind.TRAIN_RES, "dev001", run_id=RUN_ID, round=3, msg_id=msg_id(0), timestamp=TIMESTAMP,
                      groups={"shared": {"head.bias": np.array([0.5, -1.0], np.float32)}},
                      metrics={"num_examples": 120}, config={"in_reply_to": msg_id(1)})
    reply = Envelope(Kind.TRAIN_RES, "dev001", run_id=RUN_ID, round=3, msg_id=msg_id(2), timestamp=TIMESTAMP,
                     groups={"shared": {"head.bias": np.array([0.5, -1.0], np.float32),
                                        "head.weight": np.array([[1.0, 2.0], [-0.25, 0.0]], np.float32)}},
                     metrics={"num_examples": 120, "loss": 0.75}, config={"in_reply_to": msg_id(1)})
    train = Envelope(Kind.TRAIN, "coordinator", run_id=RUN_ID, round=3, msg_id=msg_id(1), timestamp=TIMESTAMP,
                     groups={"shared": {"head.bias": np.array([0.25, -0.5], np.float32)}},
                     config={"selected": ["dev000", "dev001"]})
    hello = Envelope(Kind.HELLO, "dev001", run_id="", round=0, msg_id=msg_id(3), timestamp=TIMESTAMP,
                     metrics={"num_examples": 120, "num_test": 30},
                     config={"device_type": "trainer", "task": "digits"})
    return [
        {"name": "worked_example", "note": "docs/PROTOCOL.md §4, byte for byte (271 bytes)",
         "hex": wire.encode(worked).hex(), "meaning": envelope_meaning(worked)},
        {"name": "train", "note": "a TRAIN broadcast selecting two devices",
         "hex": wire.encode(train).hex(), "meaning": envelope_meaning(train)},
        {"name": "train_res", "note": "the reply to `train`: config.in_reply_to is the TRAIN's msg_id",
         "hex": wire.encode(reply).hex(), "meaning": envelope_meaning(reply)},
        {"name": "hello", "note": "a trainer registers: run_id empty, round 0",
         "hex": wire.encode(hello).hex(), "meaning": envelope_meaning(hello)},
    ]


def arrays() -> list[dict[str, Any]]:
    cases: list[tuple[str, np.ndarray]] = [
        ("float64_vector", np.array([1.5, -2.0, 1e-300], np.float64)),
        ("float32_matrix", np.array([[0.5, -1.0, 2.0], [3.25, 0.0, -0.0]], np.float32)),
        ("float16_vector", np.array([1.0, -0.5, 65504.0], np.float16)),
        ("int64_vector", np.array([-(2**40), 0, 2**62], np.int64)),
        ("int32_vector", np.array([-1, 2, 2**31 - 1], np.int32)),
        ("int16_vector", np.array([-32768, 7], np.int16)),
        ("int8_matrix", np.array([[-127, 0], [1, 127]], np.int8)),
        ("uint8_vector", np.array([0, 128, 255], np.uint8)),
        ("bool_vector", np.array([True, False, True], np.bool_)),
        ("scalar_float32", np.array(0.125, np.float32)),
        ("scalar_int64", np.array(42, np.int64)),
        ("empty_vector", np.zeros((0,), np.float32)),
        ("empty_matrix", np.zeros((2, 0), np.int32)),
        ("rank3", np.arange(8, dtype=np.int16).reshape(2, 2, 2)),
    ]
    out = []
    for name, value in cases:
        packed: list = []
        wire.pack_pieces(wire.encode_array(value), packed)
        out.append({"name": name, "hex": b"".join(bytes(piece) for piece in packed).hex(),
                    "meaning": array_meaning(value)})
    return out


def chunk_vectors() -> tuple[dict[str, Any], dict[str, bytes]]:
    """A TRAIN envelope of about 40 kB cut into 16 KiB frames (3 frames, the last shorter)."""
    weights = (np.arange(9_950, dtype=np.float32) % 251 - 125.0) / 8.0  # ~39.8 kB of float32
    envelope = Envelope(Kind.TRAIN, "coordinator", run_id=RUN_ID, round=1, msg_id=msg_id(4), timestamp=TIMESTAMP,
                        groups={"shared": {"body.weight": weights}}, config={"selected": ["dev001"]})
    payload = wire.encode(envelope)
    frames = chunk_frames(payload, MIN_CHUNK_SIZE)
    files = {"chunks/payload.bin": payload}
    listed = []
    offset = 0
    for index, frame in enumerate(frames):
        obj = wire.unpack(frame)
        data = bytes(obj["chunk"]["data"])
        name = f"chunks/frame-{index}.bin"
        files[name] = frame
        listed.append({"file": name, "frame_bytes": len(frame), "frame_sha256": hashlib.sha256(frame).hexdigest(),
                       "blob": obj["chunk"]["blob"], "index": obj["chunk"]["index"], "count": obj["chunk"]["count"],
                       "size": obj["chunk"]["size"], "data_offset_in_payload": offset, "data_bytes": len(data),
                       "frame_prefix_hex": bytes(frame[:frame.index(data)]).hex()})
        offset += len(data)
    manifest = {
        "chunk_size": MIN_CHUNK_SIZE, "payload": "chunks/payload.bin", "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "payload_meaning": {**envelope_meaning(envelope), "groups": {"shared": {"body.weight": {
            "dtype": "float32", "shape": [len(weights)], "values_rule": "(i % 251 - 125) / 8 for i in 0..9949"}}}},
        "frames": listed,
        "corrupted": "flip any bit of a frame's data: the reassembled sha256 differs from `blob`, so the receiver "
                     "drops the message with chunk_checksum",
    }
    return manifest, files


def codec_vectors() -> dict[str, Any]:
    received: dict[str, ArrayGroup] = {"shared": {"w": np.array([1.0, 2.0, -1.0, 0.5], np.float32),
                                                  "b": np.array([0.0, 0.0], np.float32)}}
    update: dict[str, ArrayGroup] = {"shared": {
        "w": np.array([1.5, 1.0, -1.0, 1.75], np.float32),  # delta 0.5, -1, 0, 1.25
        "b": np.array([-2.5, 1.5], np.float32),
        "extra": np.array([0.5, -1.0, 127.0], np.float32),  # not broadcast: sent as it is
        "steps": np.array([3], np.int64)}}  # integer arrays travel unchanged
    ties: dict[str, ArrayGroup] = {"shared": {"t": np.array([-2.5, 1.5, 0.5, 127.0, 2.5, -0.5], np.float32)}}
    inputs: list[tuple[codecs.UploadCodec, dict[str, ArrayGroup], dict[str, ArrayGroup]]] = [
        (codecs.UploadCodec("fp16"), update, received), (codecs.UploadCodec("int8"), update, received),
        (codecs.UploadCodec("int8"), ties, {"shared": {}}), *_change_codec_inputs()]
    cases = []
    for codec, groups, base in inputs:
        encoded = codecs.encode(codec, groups, base, rng=np.random.default_rng(0))
        spec = {g: {k: (v.shape, v.dtype.name) for k, v in a.items()} for g, a in groups.items()}
        case: dict[str, Any] = {
            "codec": codec.name,
            "received": {g: {k: array_meaning(v) for k, v in a.items()} for g, a in base.items()},
            "update": {g: {k: array_meaning(v) for k, v in a.items()} for g, a in groups.items()},
            "encoded": {g: {k: {**array_meaning(v), "hex": _array_hex(v)} for k, v in a.items()}
                        for g, a in encoded.items()},
        }
        if codec.name in codecs.CHANGE_ONLY:  # decoding is exact arithmetic: the coordinator's result
            decoded = codecs.decode(codec, encoded, base, spec)
            case["decoded"] = {g: {k: array_meaning(v) for k, v in a.items()} for g, a in decoded.items()}
        if codec.name == "topk":
            case["topk_fraction"] = codec.topk_fraction
        cases.append(case)
    return {
        "rules": {
            "fp16": "float16(x - b) computed in float32, where TRAIN had a float array b of the same name and shape; "
                    "else float16(x)",
            "int8": "delta = float32(x - b) (or x); s = float32(max(abs(delta)) / 127) computed in float64 then "
                    "stored as float32 in '<name>#scale' (shape []); q = clip(round_half_to_even(delta / s), -127, "
                    "127) as int8, the division in float32 by the float32 scale; q = 0 when s = 0",
            "integer and bool arrays": "unchanged",
            "q4, q2": "delta = float32(x - b); per block of 256 flattened values s = max(abs(delta)) (float32, "
                      "'<name>#scale', shape [ceil(n / 256)]); step = float32(s / L) with L = 7 (q4) or 1 (q2); "
                      "level = floor(r) + (u < r - floor(r)) with r = abs(delta) / step in float32 (0 when step = 0), "
                      "u uniform in [0, 1), at most L, negated where delta < 0; code = level + L packed 2 (q4) or 4 "
                      "(q2) per uint8 in '<name>', the first value in the least significant bits, unused slots of "
                      "the last byte holding code L. Decoded: float32(code - L) * step + float32(b). These cases' "
                      "changes are exact levels, so u does not matter",
            "topk": "delta = float32(x - b); k = ceil(topk_fraction * n) (float64); '<name>#index' = the int32 "
                    "indices (flattened, C order, increasing) of the k largest abs(delta), ties to the lower index; "
                    "'<name>' = float32 delta at those indices. Decoded: zeros with the values at the indices, "
                    "+ float32(b)",
            "float arrays not in TRAIN, under q4, q2, topk": "unchanged",
        },
        "cases": cases,
        "rounding_case": "the third case shows ties rounding to even: -2.5 -> -2, 1.5 -> 2, 0.5 -> 0, 2.5 -> 2, "
                         "-0.5 -> 0 (scale 1.0)",
    }


def _change_codec_inputs() -> list[tuple[codecs.UploadCodec, dict[str, ArrayGroup], dict[str, ArrayGroup]]]:
    """q4, q2 and topk cases whose changes sit exactly on a level (|x| / step an integer), so the
    stochastic rounding has nothing to round and any implementation gets these exact bytes."""
    levels = (np.arange(300) % 15 - 7).astype(np.float32)  # q4 levels -7..7, two blocks: 256 + 44 values
    base = (np.arange(300) % 8 * 0.25 - 1).astype(np.float32)  # sums with the change exactly
    change = np.concatenate([levels[:256] * np.float32(0.5), levels[256:] * np.float32(2.0)])  # steps 0.5 and 2
    q4 = {"shared": {"w": base + change, "extra": np.array([0.25, -3.0], np.float32), "steps": np.array([3], np.int64)}}
    q2_base = np.array([0.5, 0.5, 0.5, 0.5, 0.5, 0.5], np.float32)
    q2 = {"shared": {"w": q2_base + np.array([0.75, -0.75, 0.0, 0.75, 0.0, -0.75], np.float32)}}
    topk_base = np.zeros((2, 4), np.float32)
    topk = {"shared": {"w": np.array([[0.5, -3.0, 1.0, 3.0], [-1.0, 3.0, 0.25, 0.0]], np.float32)}}
    return [(codecs.UploadCodec("q4"), q4, {"shared": {"w": base}}),
            (codecs.UploadCodec("q2"), q2, {"shared": {"w": q2_base}}),
            (codecs.UploadCodec("topk", 0.25), topk, {"shared": {"w": topk_base}})]


def _array_hex(array: np.ndarray) -> str:
    packed: list = []
    wire.pack_pieces(wire.encode_array(array), packed)
    return b"".join(bytes(piece) for piece in packed).hex()


def seal_vectors() -> dict[str, Any]:
    envelope = Envelope(Kind.HELLO, "dev001", run_id="", round=0, msg_id=msg_id(5), timestamp=TIMESTAMP,
                        metrics={"num_examples": 120}, config={"device_type": "trainer"})
    body = wire.encode(envelope)
    sealed = b"".join(bytes(piece) for piece in signing.seal(TEST_KEY, [body]))
    tampered = bytearray(sealed)
    tampered[-1] ^= 0x01  # the body's last byte
    return {
        "algorithm": signing.ALGORITHM,
        "key_hex": TEST_KEY.hex(),
        "body_hex": body.hex(),
        "body_meaning": envelope_meaning(envelope),
        "mac_hex": hmac.new(TEST_KEY, body, hashlib.sha256).hexdigest(),
        "sealed_hex": sealed.hex(),
        "prefix_hex": signing.SEALED_PREFIX.hex(),
        "layout": "prefix (constant, up to the MAC) + 32-byte MAC + a4 'body' + bin header + body",
        "verification": [
            {"case": "sealed, right key", "payload": "sealed_hex", "key_hex": TEST_KEY.hex(), "result": "body_hex"},
            {"case": "body altered in its last bit", "payload_hex": bytes(tampered).hex(), "key_hex": TEST_KEY.hex(),
             "result": "bad_signature"},
            {"case": "another key", "payload": "sealed_hex", "key_hex": bytes(range(1, 33)).hex(),
             "result": "bad_signature"},
            {"case": "not sealed (the body alone)", "payload": "body_hex", "key_hex": TEST_KEY.hex(),
             "result": "bad_signature"},
        ],
    }


def nack_vectors() -> dict[str, Any]:
    envelope = Envelope(Kind.NACK, "coordinator", run_id=RUN_ID, round=3, msg_id=msg_id(6), timestamp=TIMESTAMP,
                        config={"in_reply_to": msg_id(2), "refused_kind": "train_res", "reason": "stale"})
    return {"topic": "edgepfl/<federation>/down/dev001/nack", "hex": wire.encode(envelope).hex(),
            "meaning": envelope_meaning(envelope),
            "note": "config.in_reply_to is the msg_id of the refused message; the device logs it and goes on"}


def refusal_vectors() -> dict[str, Any]:
    envelope = Envelope(Kind.TRAIN_RES, "dev001", run_id=RUN_ID, round=2, msg_id=msg_id(7), timestamp=TIMESTAMP,
                        config={"refused": "bad_shape", "detail": "shared/body.1.num_batches_tracked: got int64[1], "
                                                                   "want int64[]", "in_reply_to": msg_id(2)})
    return {"topic": "edgepfl/<federation>/up/dev001/train_res", "hex": wire.encode(envelope).hex(),
            "meaning": envelope_meaning(envelope),
            "note": "config.in_reply_to is the msg_id of the TRAIN refused; no groups and no metrics; the "
                    "coordinator counts it as the device's answer under its reason"}


SECAGG_DEVICES = tuple(f"dev00{i}" for i in range(1, 6))


def secagg_vectors() -> dict[str, Any]:
    """Five devices (identity key of dev00i: 32 bytes of i, test keys only), degree 2, threshold 2."""
    identities = {device: IdentityKey.from_hex(bytes([i]).hex() * 32) for i, device in enumerate(SECAGG_DEVICES, 1)}
    announced = RoundContext(RUN_ID, 3, SECAGG_DEVICES, 2, 2, None, 10)
    adverts, advert_vectors = {}, []
    for i, device in enumerate(SECAGG_DEVICES, 1):
        c_public, s_public = bytes([0x10 + i]) * 32, bytes([0x20 + i]) * 32  # stand-ins for fresh X25519 keys
        payload = KeyAdvertisement.signed_payload(announced, device, c_public, s_public)
        adverts[device] = KeyAdvertisement(device, c_public, s_public, identities[device].sign(payload))
        advert_vectors.append({"client_id": device, "c_pk_hex": c_public.hex(), "s_pk_hex": s_public.hex(),
                               "signed_payload_hex": payload.hex(), "signature_hex": adverts[device].signature.hex()})
    context = announced.with_graph_seed(graph_seed(announced, adverts))
    survivors = SECAGG_DEVICES[:4]
    signatures = []
    for signer in survivors:
        payload = survivors_payload(context, signer, survivor_set_bytes(survivors))
        signatures.append({"signer": signer, "payload_hex": payload.hex(),
                           "signature_hex": identities[signer].sign(payload).hex()})
    return {
        "identity_keys_hex": {device: key.private_hex() for device, key in identities.items()},
        "public_keys_hex": {device: key.public_hex() for device, key in identities.items()},
        "announced": {"run_id": RUN_ID, "round": 3, "participants": list(SECAGG_DEVICES), "threshold": 2,
                      "degree": 2, "length": 10},
        "announced_ctx_hex": announced.announced_bytes().hex(),
        "adverts": advert_vectors,
        "graph_seed_hex": context.graph_seed.hex() if context.graph_seed else "",
        "ctx_hex": context.bytes().hex(),
        "graph": {device: sorted(context.graph[device]) for device in SECAGG_DEVICES},
        "survivors": list(survivors),
        "survivor_signatures": signatures,
    }


def _json(document: Any) -> bytes:
    """JSON in insertion order: the order of map keys is part of the bytes a meaning encodes to."""
    return (json.dumps(document, indent=1) + "\n").encode()


def build_vectors() -> dict[str, bytes]:
    """Every file of the vectors folder, by its path relative to it."""
    chunks, chunk_files = chunk_vectors()
    files = {
        "envelope.json": _json({"vectors": envelopes()}),
        "arrays.json": _json({"vectors": arrays()}),
        "chunks.json": _json(chunks),
        "codecs.json": _json(codec_vectors()),
        "seals.json": _json(seal_vectors()),
        "nack.json": _json(nack_vectors()),
        "refusal.json": _json(refusal_vectors()),
        "secagg.json": _json(secagg_vectors()),
    }
    files.update(chunk_files)
    return files


def main() -> None:
    for name, content in build_vectors().items():
        path = HERE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        print(f"wrote {path.relative_to(HERE.parents[1])} ({len(content)} bytes)")


if __name__ == "__main__":
    main()
