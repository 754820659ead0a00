"""An in-memory secure-aggregation round for the secagg tests: devices, a server, dropouts.

Every message crosses a msgpack round trip (to_wire -> packb -> unpackb -> from_wire), as it
would over MQTT, and its packed bytes are kept so tests can search them for secrets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import msgpack
import numpy as np

from edge_sdk.secagg import (EncryptedShares, IdentityKey, KeyAdvertisement, MaskedInput, RoundContext, Roster,
                             SecAggClient, SecAggError, SecAggServer, UnmaskRequest, UnmaskResponse)
from edge_sdk.secagg.masks import private_raw

# When a device stops: never advertises, or stops after advertising, sharing keys, masking or signing the survivors.
COMPLETE, BEFORE_ADVERTISE, AFTER_ADVERTISE, AFTER_SHARE, AFTER_MASK, AFTER_CONFIRM = (
    "complete", "before_advertise", "after_advertise", "after_share", "after_mask", "after_confirm")


@cache
def identities(count: int) -> tuple[dict[str, IdentityKey], Roster]:
    keys = {f"dev{i:02d}": IdentityKey.generate() for i in range(count)}
    return keys, Roster({device: key.public_hex() for device, key in keys.items()})


def round_context(count: int, threshold: int, degree: int, length: int, round_number: int = 1) -> RoundContext:
    """The announced context of a round of `count` devices (no graph seed: the advertisements fix it)."""
    participants = tuple(sorted(identities(count)[0]))
    return RoundContext("run-a", round_number, participants, threshold, degree, None, length)


def over_wire(message: Any) -> Any:
    """`message` after the trip a device-server hop gives it."""
    return type(message).from_wire(msgpack.unpackb(msgpack.packb(message.to_wire())))


@dataclass
class Secrets:
    """What no message may carry in the clear: each device's b, s private key and the shares it holds."""

    self_seeds: dict[str, bytes] = field(default_factory=dict)
    mask_keys: dict[str, bytes] = field(default_factory=dict)
    b_shares: dict[tuple[str, str], bytes] = field(default_factory=dict)  # (owner, holder) -> share
    s_shares: dict[tuple[str, str], bytes] = field(default_factory=dict)


@dataclass
class Round:
    context: RoundContext
    server: SecAggServer
    clients: dict[str, SecAggClient]
    inputs: dict[str, np.ndarray]
    responders: set[str] = field(default_factory=set)
    packed: list[bytes] = field(default_factory=list)  # every message but the unmask responses
    packed_responses: list[bytes] = field(default_factory=list)
    secrets: Secrets = field(default_factory=Secrets)

    def send(self, message: Any) -> Any:
        self.packed.append(msgpack.packb(message.to_wire()))
        return over_wire(message)

    def expected_sum(self) -> np.ndarray:
        total = np.zeros(self.context.vector_length, dtype=np.uint32)
        for device in self.server.survivors:
            total += self.inputs[device]
        return total


def random_inputs(context: RoundContext, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {device: rng.integers(0, 2**32, context.vector_length, dtype=np.uint32)
            for device in context.participants}


def start_round(context: RoundContext, inputs: Mapping[str, np.ndarray]) -> Round:
    keys, roster = identities(len(context.participants))
    clients = {device: SecAggClient(device, keys[device], roster, context) for device in context.participants}
    return Round(context, SecAggServer(context, roster), clients, dict(inputs))


def advertise(trial: Round, devices: Sequence[str]) -> dict[str, KeyAdvertisement]:
    """The advertise stage; `trial.context` is then the server's, with the graph seed the adverts fix."""
    for device in devices:
        trial.server.add_advertisement(trial.send(trial.clients[device].advertise()))
    forwarded = {device: trial.send(advert) for device, advert in trial.server.advertisements().items()}
    trial.context = trial.server.context
    return forwarded


def share_keys(trial: Round, devices: Sequence[str], adverts: Mapping[str, KeyAdvertisement]) -> list[str]:
    """The devices that got through key sharing (one that aborts, e.g. too few neighbours, drops)."""
    sent = []
    for device in devices:
        client = trial.clients[device]
        try:
            ciphertexts = client.share_keys(adverts)
        except SecAggError:
            continue
        trial.secrets.self_seeds[device] = client._self_seed
        trial.secrets.mask_keys[device] = private_raw(client._s_private)
        trial.server.route(device, trial.send(EncryptedShares(device, ciphertexts)).ciphertexts)
        sent.append(device)
    received = []
    for device in sent:
        client = trial.clients[device]
        try:
            client.receive_shares(trial.send(EncryptedShares(device, trial.server.inbox(device))).ciphertexts)
        except SecAggError:
            continue
        for owner in client.shared_with:
            trial.secrets.b_shares[owner, device] = client._held_b[owner]
            trial.secrets.s_shares[owner, device] = client._held_s[owner]
        received.append(device)
    return received


def mask(trial: Round, devices: Sequence[str]) -> None:
    for device in devices:
        masked = trial.clients[device].mask(trial.inputs[device])
        sent = trial.send(MaskedInput(device, masked))
        trial.server.add_masked(sent.client_id, sent.vector)


def confirm(trial: Round, devices: Sequence[str]) -> list[str]:
    """The consistency stage: each of `devices` signs the survivor set; the devices that signed."""
    survivors = trial.server.survivor_set()
    signed = []
    for device in devices:
        try:
            signature = trial.clients[device].confirm(survivors)
        except SecAggError:
            continue
        trial.server.add_signature(trial.send(signature))
        signed.append(device)
    return signed


def unmask(trial: Round, devices: Sequence[str], confirming: Sequence[str] | None = None) -> None:
    """The consistency stage for `confirming` (default: `devices`), then the unmask stage for `devices`."""
    signed = set(confirm(trial, devices if confirming is None else confirming))
    for device in devices:
        if device not in signed:
            continue
        request: UnmaskRequest = trial.send(trial.server.unmask_request(device))
        try:
            response = trial.clients[device].unmask(request.survivors, request.dropped, request.signatures)
        except SecAggError:
            continue
        trial.packed_responses.append(msgpack.packb(response.to_wire()))
        response_received: UnmaskResponse = over_wire(response)
        trial.server.add_unmask_response(response_received)
        trial.responders.add(device)


def play(context: RoundContext, inputs: Mapping[str, np.ndarray], fates: Mapping[str, str]) -> Round:
    """Run every stage; fates[device] (default COMPLETE) says when a device goes silent."""
    trial = start_round(context, inputs)

    def still(devices: Sequence[str], stops: str) -> list[str]:
        return [device for device in devices if fates.get(device, COMPLETE) != stops]

    active = still(list(context.participants), BEFORE_ADVERTISE)
    adverts = advertise(trial, active)
    active = share_keys(trial, still(active, AFTER_ADVERTISE), adverts)
    active = still(active, AFTER_SHARE)
    mask(trial, active)
    active = still(active, AFTER_MASK)
    unmask(trial, still(active, AFTER_CONFIRM), confirming=active)
    return trial
