"""Device identity keys and the roster that binds device ids to them."""

from __future__ import annotations

import json

import pytest

from edge_sdk.secagg import IdentityKey, Roster, SecAggError


def test_a_roster_saved_and_loaded_verifies_its_devices_signatures(tmp_path):
    # Prepare
    keys = {"dev0": IdentityKey.generate(), "dev1": IdentityKey.generate()}
    Roster({device: key.public_hex() for device, key in keys.items()}).save(tmp_path / "roster.json")

    # Execute
    roster = Roster.load(tmp_path / "roster.json")

    # Assert
    roster.verify("dev0", b"hello", keys["dev0"].sign(b"hello"))
    assert json.loads((tmp_path / "roster.json").read_text())["version"] == 1
    with pytest.raises(SecAggError, match="bad signature from device 'dev1'"):
        roster.verify("dev1", b"hello", keys["dev0"].sign(b"hello"))
    with pytest.raises(SecAggError, match="'dev9' is not in the roster"):
        roster.verify("dev9", b"hello", keys["dev0"].sign(b"hello"))
    with pytest.raises(SecAggError, match="dev0"):
        roster.verify("dev0", b"hello", b"short")


def test_a_private_key_round_trips_through_hex():
    key = IdentityKey.generate()
    again = IdentityKey.from_hex(key.private_hex())
    assert again.public_hex() == key.public_hex() and len(key.public_hex()) == 64


@pytest.mark.parametrize(("document", "field"), [
    ([], "version"),
    ({"version": 2, "devices": {}}, "version"),
    ({"version": 1, "devices": []}, "devices"),
    ({"version": 1, "devices": {"dev0": "ab"}}, "dev0"),
    ({"version": 1, "devices": {"dev0": "zz" * 32}}, "dev0"),
    ({"version": 1, "devices": {}, "extra": 1}, "exactly"),
])
def test_a_malformed_roster_is_rejected(document, field):
    with pytest.raises(SecAggError, match=field):
        Roster.from_json(document)
