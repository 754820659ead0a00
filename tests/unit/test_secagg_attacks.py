"""A lying coordinator against honest devices: it withholds shares, tells devices different survivor
sets and redraws the graph, and the devices refuse; nothing of any single update can be rebuilt
from what they reveal. Honest rounds with dropouts still unmask exactly the survivors' sum.

The coordinator here is the test: it drives the real `SecAggClient`s (and, for what it relays,
the real `SecAggServer`), sends each device the requests it likes and keeps every share it gets.
The reference attack: the victim is given the shares of only t of its neighbours (so it masks
with those t alone), t of its neighbours are told "the victim survived" (its self-mask seed), and
for each of those t, t of its own neighbours are told "it dropped" (its mask key), no device
naming more than k - t as dropped. Against devices that check only their own request (the rule
`answered_by_the_old_rule` plays), that rebuilds the victim's update exactly.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from edge_sdk.secagg import SecAggError, combine
from edge_sdk.secagg.client import SecAggClient
from edge_sdk.secagg.consistency import graph_seed
from edge_sdk.secagg.errors import Inconsistent
from edge_sdk.secagg.masks import add_masks, pairwise_seed
from edge_sdk.secagg.messages import EncryptedShares, UnmaskResponse
from secagg_rounds import Round, advertise, confirm, mask, random_inputs, round_context, share_keys, start_round

DEGREE, THRESHOLD, LENGTH = 16, 10, 8
VICTIM = "dev00"


class Coordinator:
    """A lying coordinator: the round's masked vectors, and every share the devices revealed to it."""

    def __init__(self, count: int, victim_gets: int | None = None):
        context = round_context(count, THRESHOLD, DEGREE, LENGTH)
        self.trial = trial = start_round(context, random_inputs(context, np.random.default_rng(count)))
        self.devices = list(context.participants)
        self.adverts = adverts = advertise(trial, self.devices)
        self.context = trial.context
        self.graph = self.context.graph
        self.partners = sorted(self.graph[VICTIM])[:victim_gets] if victim_gets else sorted(self.graph[VICTIM])
        """A: the neighbours whose shares the victim is given."""
        for device in self.devices:
            trial.server.route(device, trial.clients[device].share_keys(adverts))
        for device in self.devices:
            inbox = trial.server.inbox(device)
            if device == VICTIM:
                inbox = {sender: blob for sender, blob in inbox.items() if sender in self.partners}
            trial.clients[device].receive_shares(EncryptedShares(device, inbox).ciphertexts)
        self.masked = {device: trial.clients[device].mask(trial.inputs[device]) for device in self.devices}
        self.responses: dict[str, UnmaskResponse] = {}
        self.refusals: dict[str, str] = {}

    def client(self, device: str) -> SecAggClient:
        return self.trial.clients[device]

    def plan(self) -> dict[str, set[str]]:
        """Device -> the partners of the victim it is to name as dropped: t holders for each, at
        most k - t per device, never the victim (which holds only t shares) nor the partner itself."""
        load: dict[str, set[str]] = {device: set() for device in self.devices}
        for partner in self.partners:
            holders = sorted((d for d in self.graph[partner] if d != VICTIM and len(load[d]) < DEGREE - THRESHOLD),
                             key=lambda d: (len(load[d]), d))
            assert len(holders) >= THRESHOLD, "the reference attack found no plan"
            for holder in holders[:THRESHOLD]:
                load[holder].add(partner)
        return load

    def ask(self, device: str, survivors: set[str], dropped: set[str], signatures: Mapping[str, bytes]) -> None:
        """Send `device` an unmask request; keep what it reveals, or why it refused."""
        try:
            self.responses[device] = self.client(device).unmask(survivors, dropped, signatures)
        except Inconsistent as refusal:
            self.refusals[device] = str(refusal)

    def sign(self, device: str, survivors: set[str]) -> bytes | None:
        """Send `device` the confirm stage with `survivors`; its signature, or None if it refused."""
        try:
            return self.client(device).confirm(survivors).signature
        except Inconsistent as refusal:
            self.refusals[device] = str(refusal)
            return None

    def signed(self, device: str, survivors: set[str]) -> bytes:
        """`sign` where `device` must sign."""
        signature = self.sign(device, survivors)
        assert signature is not None, self.refusals[device]
        return signature

    def rebuildable(self) -> tuple[set[str], set[str]]:
        """The devices whose self-mask seed, and whose mask key, t revealed shares rebuild."""
        b_held: dict[str, int] = {}
        s_held: dict[str, int] = {}
        for response in self.responses.values():
            for owner in response.b_shares:
                b_held[owner] = b_held.get(owner, 0) + 1
            for owner in response.s_shares:
                s_held[owner] = s_held.get(owner, 0) + 1
        return ({d for d, n in b_held.items() if n >= THRESHOLD}, {d for d, n in s_held.items() if n >= THRESHOLD})

    def exposed(self) -> set[str]:
        """The devices whose update the revealed shares unmask alone: its self-mask seed and, for each
        device it masked with, its own mask key or that device's."""
        b_known, s_known = self.rebuildable()
        return {device for device in b_known
                if device in s_known or self.client(device).shared_with <= s_known}

    def rebuild_victim(self) -> np.ndarray:
        """The victim's update from its masked vector, its self-mask seed and its partners' mask keys
        (SecAggError when the revealed shares are too few)."""
        def secret(owner: str, kind: str) -> bytes:
            shares = {self.context.share_x(holder): (r.b_shares if kind == "b" else r.s_shares)[owner]
                      for holder, r in self.responses.items() if owner in (r.b_shares if kind == "b" else r.s_shares)}
            return combine(shares, THRESHOLD)

        total = self.masked[VICTIM].copy()
        masks = [(secret(VICTIM, "b"), True)]
        victim_public = self.adverts[VICTIM].s_public
        for partner in sorted(self.client(VICTIM).shared_with):
            private = X25519PrivateKey.from_private_bytes(secret(partner, "s"))
            masks.append((pairwise_seed(private, victim_public, self.context.bytes()), VICTIM < partner))
        add_masks(total, masks)
        return total


def answered_by_the_old_rule(client: SecAggClient, survivors: set[str], dropped: set[str]) -> UnmaskResponse:
    """What a device that checks only its own request reveals: its two lists disjoint, inside its
    U2, at least t survivors (the rule before the consistency stage)."""
    survivors, dropped = survivors & client.shared_with, dropped & client.shared_with
    assert not survivors & dropped and len(survivors) >= THRESHOLD
    return UnmaskResponse(client.client_id, {p: client._held_b[p] for p in survivors},
                          {p: client._held_s[p] for p in dropped})


def everyone_but(coordinator: Coordinator, *left_out: set[str]) -> set[str]:
    return set(coordinator.devices).difference(*left_out)


@pytest.mark.parametrize("count", [30, 40, 200])
def test_the_reference_attack_rebuilds_the_victim_against_devices_that_check_only_their_own_request(count):
    # Prepare: the victim masks with t partners only; the plan names each partner dropped to t of its neighbours
    coordinator = Coordinator(count, victim_gets=THRESHOLD)
    plan = coordinator.plan()

    # Execute: every device but the victim answers its own request by the old rule
    for device, dropped in plan.items():
        if device != VICTIM:
            survivors = everyone_but(coordinator, dropped)
            coordinator.responses[device] = answered_by_the_old_rule(coordinator.client(device), survivors, dropped)

    # Assert: the victim's update, exactly
    assert max(len(dropped) for dropped in plan.values()) <= DEGREE - THRESHOLD
    np.testing.assert_array_equal(coordinator.rebuild_victim(), coordinator.trial.inputs[VICTIM])
    assert VICTIM in coordinator.exposed()


@pytest.mark.parametrize("count", [30, 40, 200])
def test_the_reference_attack_is_refused_and_rebuilds_nothing(count):
    # Prepare: as above; each device is shown, to sign, the survivor set its plan implies
    coordinator = Coordinator(count, victim_gets=THRESHOLD)
    plan = coordinator.plan()
    shown = {device: everyone_but(coordinator, dropped) for device, dropped in plan.items()}
    signatures = {device: sig for device in coordinator.devices
                  if (sig := coordinator.sign(device, shown[device])) is not None}

    # Execute: every device is asked to unmask by its plan, with every signature there is
    for device in coordinator.devices:
        if device in signatures:
            coordinator.ask(device, shown[device], plan[device], signatures)

    # Assert: the victim refused to sign (shares were withheld from it), the planned devices to unmask;
    # no update, the victim's least, can be rebuilt from what was revealed
    assert "withheld" in coordinator.refusals[VICTIM]
    planned = {device for device, dropped in plan.items() if dropped}
    assert planned <= set(coordinator.refusals)
    assert coordinator.exposed() == set()
    with pytest.raises(SecAggError):
        coordinator.rebuild_victim()


@pytest.mark.parametrize("count", [30, 200])
def test_one_survivor_set_without_the_victims_partners_is_refused_where_it_would_expose_the_victim(count):
    # Prepare: one set for everyone: the victim survived, its t partners dropped (they did not)
    coordinator = Coordinator(count, victim_gets=THRESHOLD)
    claimed = everyone_but(coordinator, set(coordinator.partners))
    signatures = {device: sig for device in coordinator.devices
                  if (sig := coordinator.sign(device, claimed)) is not None}

    # Execute
    for device in signatures:
        coordinator.ask(device, claimed, set(coordinator.partners), signatures)

    # Assert: the partners refuse to sign a set that leaves them out, the victim one that names withheld
    # senders; the self-mask seed of the victim is never rebuilt, and nothing is exposed
    assert all("leaves out" in coordinator.refusals[partner] for partner in coordinator.partners)
    assert "withheld" in coordinator.refusals[VICTIM]
    b_known, _ = coordinator.rebuildable()
    assert VICTIM not in b_known and coordinator.exposed() == set()


@pytest.mark.parametrize("count", [40, 200])
def test_a_survivor_set_that_differs_for_one_device_only_is_refused_by_it(count):
    # Prepare: every device is shown the true survivor set but one, shown it without the victim
    coordinator = Coordinator(count)
    odd = sorted(coordinator.graph[VICTIM])[0]
    everyone = set(coordinator.devices)
    signatures = {device: coordinator.signed(device, everyone - {VICTIM} if device == odd else everyone)
                  for device in coordinator.devices}

    # Execute: the odd one is asked by its own set, and by the others'
    coordinator.ask(odd, everyone - {VICTIM}, {VICTIM}, signatures)
    first = coordinator.refusals.pop(odd)
    with pytest.raises(SecAggError, match="out of order"):
        coordinator.client(odd).unmask(everyone, set(), signatures)

    # Assert: its neighbours' signatures are on another set
    assert "does not verify" in first
    assert coordinator.responses == {}


def test_a_survivor_set_other_than_the_one_signed_is_refused():
    # Prepare
    coordinator = Coordinator(40)
    everyone = set(coordinator.devices)
    signatures = {device: coordinator.signed(device, everyone) for device in coordinator.devices}
    device = sorted(coordinator.graph[VICTIM])[0]

    # Execute
    coordinator.ask(device, everyone - {VICTIM}, {VICTIM}, signatures)

    # Assert
    assert f"differs from the one {device!r} signed (on {VICTIM!r})" in coordinator.refusals[device]


def test_shares_withheld_from_one_device_make_it_refuse_to_sign_a_set_naming_their_senders():
    # Prepare: the victim got the shares of t of its 16 neighbours; every device is alive
    coordinator = Coordinator(40, victim_gets=THRESHOLD)
    withheld = sorted(coordinator.graph[VICTIM] - set(coordinator.partners))

    # Execute
    signature = coordinator.sign(VICTIM, set(coordinator.devices))

    # Assert
    assert signature is None and f"names {withheld[0]!r}, whose shares were withheld" in coordinator.refusals[VICTIM]


def test_fewer_than_threshold_valid_signatures_from_neighbours_reveal_nothing():
    # Prepare: all sign the true set; the coordinator forwards only t - 1 of a device's neighbours'
    coordinator = Coordinator(40)
    everyone = set(coordinator.devices)
    signatures = {device: coordinator.signed(device, everyone) for device in coordinator.devices}
    device = "dev05"
    kept = sorted(coordinator.graph[device])[:THRESHOLD - 1]

    # Execute
    coordinator.ask(device, everyone, set(), {peer: signatures[peer] for peer in kept})

    # Assert
    assert f"{THRESHOLD - 1} neighbours of {device!r} signed the survivor set" in coordinator.refusals[device]
    assert coordinator.responses == {}


def test_a_redrawn_graph_seed_leaves_the_device_on_another_graph_whose_shares_do_not_decrypt():
    # Prepare: the coordinator forwards one device every advertisement but one, to redraw its graph
    context = round_context(40, THRESHOLD, DEGREE, LENGTH)
    trial = start_round(context, random_inputs(context, np.random.default_rng(1)))
    adverts = advertise(trial, list(context.participants))
    redrawn = {peer: advert for peer, advert in adverts.items() if peer != "dev39"}
    trial.clients[VICTIM].share_keys(redrawn)
    for device in context.participants[1:]:
        trial.server.route(device, trial.clients[device].share_keys(adverts))
    victim = trial.clients[VICTIM]
    inbox = trial.server.inbox(VICTIM)
    common = sorted(set(inbox) & victim.neighbours)

    # Execute / Assert: the victim computed another seed, so another graph and context: the shares of the
    # neighbours it still has do not decrypt for it
    assert victim.context.graph_seed != trial.server.context.graph_seed and common
    with pytest.raises(SecAggError, match=f"ciphertext from {common[0]!r} does not decrypt"):
        victim.receive_shares({sender: inbox[sender] for sender in common})


def test_a_context_with_a_chosen_graph_seed_is_refused_by_devices_and_server():
    # Prepare
    context = round_context(6, 3, 4, LENGTH).with_graph_seed(bytes(32))
    keys = start_round(round_context(6, 3, 4, LENGTH), {}).clients["dev00"]

    # Execute / Assert
    with pytest.raises(SecAggError, match="without a graph seed"):
        SecAggClient("dev00", keys.identity, keys.roster, context)


def test_the_graph_seed_is_every_partys_hash_of_the_advertisements_and_moves_with_any_of_them():
    # Prepare
    context = round_context(30, THRESHOLD, DEGREE, LENGTH)
    trial = start_round(context, {})
    adverts = advertise(trial, list(context.participants))
    for client in trial.clients.values():
        client.share_keys(adverts)

    # Assert: every device and the server derived one seed; it places the ids on the ring by HMAC
    seeds = {client.context.graph_seed for client in trial.clients.values()}
    assert seeds == {trial.server.context.graph_seed}
    ring = ring_order(trial)
    assert trial.server.context.graph[ring[0]] >= {ring[1], ring[-1]}
    # any other advertisement set (one left out) gives another seed
    fewer = dict(list(adverts.items())[1:])
    assert graph_seed(context, fewer) != seeds.pop()


def ring_order(trial: Round) -> list[str]:
    seed = trial.server.context.graph_seed
    assert seed is not None
    return sorted(trial.context.participants, key=lambda d: hmac.new(seed, d.encode(), hashlib.sha256).digest())


@pytest.mark.parametrize(("count", "dropout"), [(40, 0.1), (40, 0.3), (200, 0.1), (200, 0.3)])
def test_honest_rounds_with_dropouts_unmask_exactly_the_survivors_sum(count, dropout):
    # Prepare: a share of the devices, spread over the ring, drops after sharing keys
    context = round_context(count, THRESHOLD, DEGREE, LENGTH)
    trial = start_round(context, random_inputs(context, np.random.default_rng(7)))
    devices = list(context.participants)
    share_keys(trial, devices, advertise(trial, devices))
    ring = ring_order(trial)
    lost_places = {0} if dropout == 0.1 else {0, 3, 6}  # of every 10 on the ring
    dropped = {device for place, device in enumerate(ring) if place % 10 in lost_places}
    alive = [device for device in devices if device not in dropped]

    # Execute
    mask(trial, alive)
    signed = confirm(trial, alive)
    for device in signed:
        request = trial.server.unmask_request(device)
        trial.server.add_unmask_response(trial.clients[device].unmask(request.survivors, request.dropped,
                                                                      request.signatures))

    # Assert
    assert len(dropped) == pytest.approx(dropout * count, abs=1) and set(signed) == set(alive)
    np.testing.assert_array_equal(trial.server.result(), trial.expected_sum())


def test_a_survivor_lost_before_signing_is_still_unmasked_by_its_neighbours():
    # Prepare: dev03 sends its masked vector, then never signs
    context = round_context(40, THRESHOLD, DEGREE, LENGTH)
    trial = start_round(context, random_inputs(context, np.random.default_rng(2)))
    devices = list(context.participants)
    share_keys(trial, devices, advertise(trial, devices))
    mask(trial, devices)

    # Execute
    signed = confirm(trial, [device for device in devices if device != "dev03"])
    for device in signed:
        request = trial.server.unmask_request(device)
        trial.server.add_unmask_response(trial.clients[device].unmask(request.survivors, request.dropped,
                                                                      request.signatures))

    # Assert: its input is in the sum
    assert "dev03" in trial.server.survivors and "dev03" not in trial.server.signers
    np.testing.assert_array_equal(trial.server.result(), trial.expected_sum())


@pytest.mark.parametrize("reach", [4, 8, 12, 16])
def test_two_survivor_sets_split_over_the_ring_rebuild_no_update(reach):
    # Prepare: devices within `reach` ring places of the victim are shown the set without its t partners
    # (their mask keys), the others the true set (the victim's self-mask seed)
    coordinator = Coordinator(40, victim_gets=THRESHOLD)
    ring = ring_order(coordinator.trial)
    place = ring.index(VICTIM)
    near = {device for i, device in enumerate(ring) if min(abs(i - place), len(ring) - abs(i - place)) <= reach}
    everyone, partners = set(coordinator.devices), set(coordinator.partners)
    shown = {device: everyone - partners if device in near else everyone for device in coordinator.devices}
    signatures = {device: sig for device in coordinator.devices
                  if (sig := coordinator.sign(device, shown[device])) is not None}

    # Execute
    for device in signatures:
        coordinator.ask(device, shown[device], partners & coordinator.graph[device] if device in near else set(),
                        signatures)

    # Assert: whatever each side revealed, no single update can be rebuilt
    assert coordinator.exposed() == set()
    with pytest.raises(SecAggError):
        coordinator.rebuild_victim()
