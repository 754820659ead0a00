"""Enrolling devices for secure aggregation: an Ed25519 identity key per device, kept by that
device alone, and the roster of every device's public key, which every device holds.

The roster is what makes a coordinator unable to substitute a device's round keys: it comes from
the operator's enrollment, not from the coordinator. A device's identity file is 64 hex digits,
written readable by its owner only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from .identity import IdentityKey, Roster


def enroll(devices: Iterable[str], identity_path: Callable[[str], Path], roster_path: Path) -> Roster:
    """Write a fresh identity key for each device (at `identity_path(id)`) and the roster of
    their public keys (at `roster_path`); returns the roster."""
    public: dict[str, str] = {}
    for device in devices:
        key = IdentityKey.generate()
        path = identity_path(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(key.private_hex() + "\n")
        public[device] = key.public_hex()
    roster = Roster(public)
    roster_path.parent.mkdir(parents=True, exist_ok=True)
    roster.save(roster_path)
    return roster

