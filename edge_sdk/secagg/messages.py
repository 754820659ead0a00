"""The messages of a secure-aggregation round, as plain msgpack-able dicts with strict parsing.

Each message is a frozen dataclass whose constructor checks every field (type, size), and whose
`to_wire()` gives a dict of str, int, bytes and lists/dicts of those. `from_wire()` accepts exactly
the fields `to_wire()` writes and raises SecAggError naming the first field that is missing,
unexpected, of the wrong type or of the wrong size; nothing from the network is unpickled.

Stages: KeyAdvertisement (device -> server -> every device), EncryptedShares (device -> server,
and server -> device with the same shape), MaskedInput (device -> server), SurvivorSignature
(device -> server -> every survivor), UnmaskRequest (server -> device), UnmaskResponse (device
-> server).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .context import MAX_ID_BYTES, RoundContext, canonical, is_device_id
from .errors import SecAggError
from .identity import SIGNATURE_BYTES
from .masks import PUBLIC_KEY_BYTES
from .shamir import SHARE_BYTES

NONCE_BYTES = 12
TAG_BYTES = 16
# nonce || AES-GCM(canonical(sender, recipient) || share of b || share of s) || tag
MIN_CIPHERTEXT_BYTES = NONCE_BYTES + 8 + 2 + 2 * SHARE_BYTES + TAG_BYTES
MAX_CIPHERTEXT_BYTES = NONCE_BYTES + 8 + 2 * MAX_ID_BYTES + 2 * SHARE_BYTES + TAG_BYTES
ADVERTISE_DOMAIN = b"edgepfl-secagg-advertise"


def _message_fields(wire: object, message: str, names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(wire, dict):
        raise SecAggError(f"{message} must be a map, got {type(wire).__name__}")
    for name in names:
        if name not in wire:
            raise SecAggError(f"{message}: missing field {name!r}")
    extra = sorted(map(repr, set(wire) - set(names)))
    if extra:
        raise SecAggError(f"{message}: unexpected field {extra[0]}")
    return wire


def _check_id(value: object, field: str) -> str:
    if not is_device_id(value):
        raise SecAggError(f"{field} must be a device id (non-empty string of at most {MAX_ID_BYTES} bytes), "
                          f"got {value!r}")
    return value


def _check_bytes(value: object, field: str, low: int, high: int | None = None) -> bytes:
    if not isinstance(value, bytes):
        raise SecAggError(f"{field} must be bytes, got {type(value).__name__}")
    high = low if high is None else high
    if not low <= len(value) <= high:
        size = str(low) if low == high else f"{low}..{high}"
        raise SecAggError(f"{field} must be {size} bytes, got {len(value)}")
    return value


def _check_peer_map(value: object, field: str, low: int, high: int | None = None) -> dict[str, bytes]:
    if not isinstance(value, Mapping):
        raise SecAggError(f"{field} must be a map of device id to bytes, got {type(value).__name__}")
    return {_check_id(peer, f"{field} key"): _check_bytes(data, f"{field}[{peer!r}]", low, high)
            for peer, data in value.items()}


def _check_id_list(value: object, field: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise SecAggError(f"{field} must be a list of device ids, got {type(value).__name__}")
    ids = tuple(_check_id(item, f"{field} item") for item in value)
    if len(set(ids)) != len(ids):
        raise SecAggError(f"{field} names a device twice")
    return tuple(sorted(ids))


@dataclass(frozen=True)
class KeyAdvertisement:
    """A device's two fresh X25519 public keys for the round (c: share encryption, s: pairwise masks),
    signed with its identity key over (announced context, client_id, c_public, s_public)."""

    client_id: str
    c_public: bytes
    s_public: bytes
    signature: bytes

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")
        _check_bytes(self.c_public, "c_pk", PUBLIC_KEY_BYTES)
        _check_bytes(self.s_public, "s_pk", PUBLIC_KEY_BYTES)
        _check_bytes(self.signature, "signature", SIGNATURE_BYTES)

    @staticmethod
    def signed_payload(context: RoundContext, client_id: str, c_public: bytes, s_public: bytes) -> bytes:
        """The bytes the identity signature covers (the context without its graph seed, which these fix)."""
        return canonical(ADVERTISE_DOMAIN, context.announced_bytes(), client_id.encode(), c_public, s_public)

    def to_wire(self) -> dict[str, Any]:
        return {"client_id": self.client_id, "c_pk": self.c_public, "s_pk": self.s_public,
                "signature": self.signature}

    @classmethod
    def from_wire(cls, wire: object) -> KeyAdvertisement:
        fields = _message_fields(wire, "key advertisement", ("client_id", "c_pk", "s_pk", "signature"))
        return cls(fields["client_id"], fields["c_pk"], fields["s_pk"], fields["signature"])


@dataclass(frozen=True)
class EncryptedShares:
    """Share ciphertexts: from `client_id` to each peer (uplink), or to `client_id` from each peer
    (what the server forwards); each value is nonce || AES-GCM ciphertext."""

    client_id: str
    ciphertexts: Mapping[str, bytes]

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")
        object.__setattr__(self, "ciphertexts", _check_peer_map(self.ciphertexts, "ciphertexts",
                                                                MIN_CIPHERTEXT_BYTES, MAX_CIPHERTEXT_BYTES))

    def to_wire(self) -> dict[str, Any]:
        return {"client_id": self.client_id, "ciphertexts": dict(self.ciphertexts)}

    @classmethod
    def from_wire(cls, wire: object) -> EncryptedShares:
        fields = _message_fields(wire, "encrypted shares", ("client_id", "ciphertexts"))
        return cls(fields["client_id"], fields["ciphertexts"])


@dataclass(frozen=True)
class MaskedInput:
    """A device's masked vector: uint32 words, little-endian on the wire."""

    client_id: str
    vector: np.ndarray

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")
        if not isinstance(self.vector, np.ndarray) or self.vector.dtype != np.uint32 or self.vector.ndim != 1:
            raise SecAggError("vector must be a 1-D uint32 numpy array")
        if self.vector.size == 0:
            raise SecAggError("vector must not be empty")

    def to_wire(self) -> dict[str, Any]:
        return {"client_id": self.client_id, "vector": self.vector.astype("<u4").tobytes()}

    @classmethod
    def from_wire(cls, wire: object) -> MaskedInput:
        fields = _message_fields(wire, "masked input", ("client_id", "vector"))
        data = fields["vector"]
        if not isinstance(data, bytes) or not data or len(data) % 4:
            raise SecAggError("vector must be non-empty bytes, a multiple of 4 long")
        return cls(fields["client_id"], np.frombuffer(data, dtype="<u4").astype(np.uint32))


@dataclass(frozen=True)
class SurvivorSignature:
    """A survivor's Ed25519 signature, with its identity key, on the round's survivor set it was
    shown (consistency.survivors_payload): what its neighbours need before they reveal shares."""

    client_id: str
    signature: bytes

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")
        _check_bytes(self.signature, "signature", SIGNATURE_BYTES)

    def to_wire(self) -> dict[str, Any]:
        return {"client_id": self.client_id, "signature": self.signature}

    @classmethod
    def from_wire(cls, wire: object) -> SurvivorSignature:
        fields = _message_fields(wire, "survivor signature", ("client_id", "signature"))
        return cls(fields["client_id"], fields["signature"])


@dataclass(frozen=True)
class UnmaskRequest:
    """The server's claim: the round's survivor set (the devices whose masked vectors arrived),
    the devices that dropped after sharing keys, and the survivors' signatures on that set."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    signatures: Mapping[str, bytes]

    def __post_init__(self) -> None:
        object.__setattr__(self, "survivors", _check_id_list(self.survivors, "survivors"))
        object.__setattr__(self, "dropped", _check_id_list(self.dropped, "dropped"))
        object.__setattr__(self, "signatures", _check_peer_map(self.signatures, "signatures", SIGNATURE_BYTES))

    def to_wire(self) -> dict[str, Any]:
        return {"survivors": list(self.survivors), "dropped": list(self.dropped), "signatures": dict(self.signatures)}

    @classmethod
    def from_wire(cls, wire: object) -> UnmaskRequest:
        fields = _message_fields(wire, "unmask request", ("survivors", "dropped", "signatures"))
        return cls(fields["survivors"], fields["dropped"], fields["signatures"])


@dataclass(frozen=True)
class UnmaskResponse:
    """A device's answer: its share of the self-mask seed of each surviving neighbour, and its share
    of the mask private key of each dropped neighbour (never both for one neighbour)."""

    client_id: str
    b_shares: Mapping[str, bytes]
    s_shares: Mapping[str, bytes]

    def __post_init__(self) -> None:
        _check_id(self.client_id, "client_id")
        object.__setattr__(self, "b_shares", _check_peer_map(self.b_shares, "b_shares", SHARE_BYTES))
        object.__setattr__(self, "s_shares", _check_peer_map(self.s_shares, "s_shares", SHARE_BYTES))
        both = sorted(set(self.b_shares) & set(self.s_shares))
        if both:
            raise SecAggError(f"b_shares and s_shares both name {both[0]!r}")

    def to_wire(self) -> dict[str, Any]:
        return {"client_id": self.client_id, "b_shares": dict(self.b_shares), "s_shares": dict(self.s_shares)}

    @classmethod
    def from_wire(cls, wire: object) -> UnmaskResponse:
        fields = _message_fields(wire, "unmask response", ("client_id", "b_shares", "s_shares"))
        return cls(fields["client_id"], fields["b_shares"], fields["s_shares"])
