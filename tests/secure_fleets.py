"""Securely aggregating fleets over the loopback broker (tests/loopback_runs.py), for the run
tests of secure aggregation and of distributed DP under it."""

from __future__ import annotations

from edge_sdk.secagg import IdentityKey, Roster
from edge_sdk.secagg.device import SecAggKeys
from loopback_runs import BlockingLock

DEVICES = 4


def fleet_keys(count: int) -> list[SecAggKeys]:
    identities = [IdentityKey.generate() for _ in range(count)]
    roster = Roster({f"dev{i:03d}": key.public_hex() for i, key in enumerate(identities)})
    return [SecAggKeys(identity, roster) for identity in identities]


def start_with_the_last_lost(federation, parked: BlockingLock) -> str:
    """Start the DEVICES enrolled devices; the last is parked by `parked` inside its training and
    announced offline then (after it shared its keys). Returns its id."""
    keys = fleet_keys(DEVICES)
    for i in range(DEVICES - 1):
        federation.start_device(i, DEVICES, secagg_keys=keys[i])
    lost = federation.start_device(DEVICES - 1, DEVICES, compute_lock=parked, secagg_keys=keys[-1])
    federation.lose_when_parked(parked, lost)
    return lost
