"""Per-device Ed25519 identity keys, and the roster of their public halves.

A device signs the keys it advertises for a round with its identity key; its neighbours check
the signature against the roster before they share secrets with those keys. This is what stops
the coordinator from putting its own keys in place of a device's (and so learning the device's
mask): the coordinator holds every device's HMAC signing key (edge_sdk.signing), so HMAC proves
nothing between devices, whereas it never holds an identity private key.

Roster file: `{"version": 1, "devices": {"dev0": "<64 hex: Ed25519 public key>", ...}}`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import SecAggError

KEY_BYTES = 32
SIGNATURE_BYTES = 64
ROSTER_VERSION = 1


def _raw_key(text: object, what: str) -> bytes:
    if not isinstance(text, str) or len(text) != 2 * KEY_BYTES:
        raise SecAggError(f"{what} must be {2 * KEY_BYTES} hex characters")
    try:
        return bytes.fromhex(text)
    except ValueError as error:
        raise SecAggError(f"{what} is not hex") from error


def _public_raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class IdentityKey:
    """A device's Ed25519 signing key (kept on the device; only its public half is enrolled)."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private

    @classmethod
    def generate(cls) -> IdentityKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_hex(cls, text: str) -> IdentityKey:
        return cls(Ed25519PrivateKey.from_private_bytes(_raw_key(text, "identity private key")))

    def private_hex(self) -> str:
        return self._private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption()).hex()

    def public_hex(self) -> str:
        return _public_raw(self._private.public_key()).hex()

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)


MAX_VERIFIED = 1 << 16
"""How many verified signatures a roster remembers before it starts over."""


class Roster:
    """Device id -> Ed25519 public key: whose signatures the round accepts as whose."""

    def __init__(self, devices: Mapping[str, str]) -> None:
        """`devices` maps each device id to its public key in hex."""
        self._verified: set[bytes] = set()
        """SHA-256 of each (id, message, signature) that verified: every device checks every
        advertisement of a round, and devices that share one roster (a simulation) check each once."""
        self._keys: dict[str, Ed25519PublicKey] = {}
        for device_id, text in devices.items():
            if not isinstance(device_id, str) or not device_id:
                raise SecAggError(f"roster device id must be a non-empty string, got {device_id!r}")
            raw = _raw_key(text, f"roster key of {device_id!r}")
            self._keys[device_id] = Ed25519PublicKey.from_public_bytes(raw)

    @classmethod
    def from_json(cls, document: object) -> Roster:
        if not isinstance(document, dict) or set(document) != {"version", "devices"}:
            raise SecAggError('roster must be an object with exactly "version" and "devices"')
        if document["version"] != ROSTER_VERSION:
            raise SecAggError(f"roster version must be {ROSTER_VERSION}, got {document['version']!r}")
        if not isinstance(document["devices"], dict):
            raise SecAggError('roster "devices" must be an object')
        return cls(document["devices"])

    @classmethod
    def load(cls, path: str | Path) -> Roster:
        try:
            document = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise SecAggError(f"roster {path} is not JSON: {error}") from error
        return cls.from_json(document)

    def to_json(self) -> dict[str, object]:
        return {"version": ROSTER_VERSION,
                "devices": {device_id: _public_raw(key).hex() for device_id, key in sorted(self._keys.items())}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    def __contains__(self, device_id: object) -> bool:
        return device_id in self._keys

    def verify(self, device_id: str, message: bytes, signature: bytes) -> None:
        """Return if `device_id` signed `message`; SecAggError naming the device otherwise."""
        key = self._keys.get(device_id)
        if key is None:
            raise SecAggError(f"device {device_id!r} is not in the roster")
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            raise SecAggError(f"signature of device {device_id!r} must be {SIGNATURE_BYTES} bytes")
        digest = hashlib.sha256(b"".join(len(part).to_bytes(4, "big") + part
                                         for part in (device_id.encode(), message, signature))).digest()
        if digest in self._verified:
            return
        try:
            key.verify(signature, message)
        except InvalidSignature as error:
            raise SecAggError(f"bad signature from device {device_id!r}") from error
        if len(self._verified) >= MAX_VERIFIED:
            self._verified.clear()
        self._verified.add(digest)
