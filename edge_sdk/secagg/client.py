"""One device's side of a secure-aggregation round (SecAgg+): keys, shares, masking, unmasking.

A `SecAggClient` lives for one round and walks its stages in order, each exactly once:
advertise -> share_keys -> receive_shares -> mask -> confirm -> unmask. Each stage returns what
the device sends next. It starts from the announced context (no graph seed) and derives the seed
itself from the forwarded advertisements (consistency.py). Any violation (a bad signature, a
ciphertext that does not decrypt, a stage out of order, a survivor set that contradicts what it
knows or signed) raises SecAggError naming the field or device; `Inconsistent` when the server's
claims contradict each other or this device's view. The device then sends nothing more this
round but its refusal, which the server sees as a dropout.
"""

from __future__ import annotations

import os
import secrets
import struct
from collections.abc import Collection, Mapping

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .consistency import graph_seed, survivor_set_bytes, survivors_payload
from .context import RoundContext, canonical
from .errors import Inconsistent, SecAggError
from .identity import IdentityKey, Roster
from .masks import SEED_BYTES, add_masks, derive_key, pairwise_seed, private_raw, public_raw, shared_secret
from .messages import NONCE_BYTES, KeyAdvertisement, SurvivorSignature, UnmaskResponse
from .shamir import SHARE_BYTES, split

SHARE_KEY_INFO = b"edgepfl-secagg-share"
_STAGES = ("advertise", "share_keys", "receive_shares", "mask", "confirm", "unmask", "done")


def share_aad(context: RoundContext, sender: str, recipient: str) -> bytes:
    """The AES-GCM associated data of the shares `sender` encrypts for `recipient`."""
    return canonical(context.bytes(), sender.encode(), recipient.encode())


def _parse_share_plaintext(plaintext: bytes) -> tuple[str, str, bytes, bytes]:
    """(sender, recipient, share of b, share of s) from canonical(sender, recipient) || b || s."""
    ids = []
    offset = 0
    for _ in range(2):
        if len(plaintext) < offset + 4:
            raise SecAggError("share plaintext is truncated")
        (size,) = struct.unpack_from(">I", plaintext, offset)
        try:
            ids.append(plaintext[offset + 4:offset + 4 + size].decode("utf-8"))
        except UnicodeDecodeError as error:
            raise SecAggError("share plaintext names an id that is not UTF-8") from error
        offset += 4 + size
    if len(plaintext) != offset + 2 * SHARE_BYTES:
        raise SecAggError("share plaintext has the wrong length")
    return ids[0], ids[1], plaintext[offset:offset + SHARE_BYTES], plaintext[offset + SHARE_BYTES:]


class SecAggClient:
    """A device's state for one round; see the module docstring for the stage order."""

    def __init__(self, client_id: str, identity: IdentityKey, roster: Roster, context: RoundContext) -> None:
        """`context` is the announced one: a graph seed given here would be someone's choice (SecAggError)."""
        if context.graph_seed is not None:
            raise SecAggError("the round context must come without a graph seed: each device derives it from the "
                              "advertisements")
        if client_id not in context.participants:
            raise SecAggError(f"{client_id!r} is not a participant of this round")
        self.client_id = client_id
        self.identity = identity
        self.roster = roster
        self.context = context
        self.neighbours: frozenset[str] = frozenset()
        """This device's neighbours in the round's graph (set by share_keys, once the seed is derived)."""
        self._stage = 0
        self._c_private = X25519PrivateKey.generate()
        self._s_private = X25519PrivateKey.generate()
        self._own_advert: KeyAdvertisement | None = None
        self._peer_adverts: dict[str, KeyAdvertisement] = {}
        self._self_seed = b""
        self._held_b: dict[str, bytes] = {}
        self._held_s: dict[str, bytes] = {}
        self.shared_with: frozenset[str] = frozenset()
        """U2 as this device sees it: the neighbours whose shares it received (set by receive_shares)."""
        self.signed: frozenset[str] | None = None
        """The survivor set this device signed (set by confirm): the only one it reveals shares for."""

    def _enter(self, stage: str) -> None:
        expected = _STAGES[self._stage]
        if stage != expected:
            raise SecAggError(f"{self.client_id}: {stage} called out of order (next stage is {expected})")
        self._stage += 1

    def _share_key(self, peer: str) -> AESGCM:
        secret = shared_secret(self._c_private, self._peer_adverts[peer].c_public)
        return AESGCM(derive_key(secret, SHARE_KEY_INFO + self.context.bytes()))

    def advertise(self) -> KeyAdvertisement:
        """The round's two public keys (c: share encryption, s: pairwise masks), signed by the identity key."""
        self._enter("advertise")
        c_public, s_public = public_raw(self._c_private), public_raw(self._s_private)
        payload = KeyAdvertisement.signed_payload(self.context, self.client_id, c_public, s_public)
        self._own_advert = KeyAdvertisement(self.client_id, c_public, s_public, self.identity.sign(payload))
        return self._own_advert

    def share_keys(self, adverts: Mapping[str, KeyAdvertisement]) -> dict[str, bytes]:
        """Neighbour id -> nonce || AES-GCM ciphertext of this device's shares of b and s_sk for it.

        Verifies every forwarded advertisement's signature against the roster (a substituted key
        or an invented advertisement fails here, naming the device), then derives the graph seed
        from all of them, and with it this device's neighbours; participants absent from
        `adverts` dropped out. Its own advertisement must be there as it sent it.
        """
        self._enter("share_keys")
        if adverts.get(self.client_id) != self._own_advert:
            raise Inconsistent(f"the advertisements forwarded leave out or alter {self.client_id!r}'s own")
        for peer in sorted(adverts):
            advert = adverts[peer]
            if not isinstance(advert, KeyAdvertisement) or advert.client_id != peer:
                raise SecAggError(f"advertisement listed under {peer!r} is not {peer!r}'s")
            if peer not in self.context.participants:
                raise Inconsistent(f"advertisement of {peer!r}, which is not a participant of this round")
            payload = KeyAdvertisement.signed_payload(self.context, peer, advert.c_public, advert.s_public)
            self.roster.verify(peer, payload, advert.signature)
        self.context = self.context.with_graph_seed(graph_seed(self.context, adverts))
        self.neighbours = self.context.neighbours_of(self.client_id)
        self._peer_adverts = {peer: adverts[peer] for peer in sorted(self.neighbours & set(adverts))}
        if len(self._peer_adverts) < self.context.threshold:
            raise SecAggError(f"{self.client_id}: only {len(self._peer_adverts)} neighbours advertised keys, "
                              f"threshold is {self.context.threshold}")
        self._self_seed = secrets.token_bytes(SEED_BYTES)
        holders = {peer: self.context.share_x(peer) for peer in self._peer_adverts}
        b_shares = split(self._self_seed, self.context.threshold, list(holders.values()))
        s_shares = split(private_raw(self._s_private), self.context.threshold, list(holders.values()))
        ciphertexts = {}
        for peer, x in holders.items():
            plaintext = canonical(self.client_id.encode(), peer.encode()) + b_shares[x] + s_shares[x]
            nonce = os.urandom(NONCE_BYTES)
            sealed = self._share_key(peer).encrypt(nonce, plaintext, share_aad(self.context, self.client_id, peer))
            ciphertexts[peer] = nonce + sealed
        return ciphertexts

    def receive_shares(self, ciphertexts: Mapping[str, bytes]) -> None:
        """Decrypt and keep the shares neighbours sent this device; their senders form U2."""
        self._enter("receive_shares")
        for sender in sorted(ciphertexts):
            if sender not in self._peer_adverts:
                raise SecAggError(f"shares from {sender!r}, which is not a neighbour that advertised keys")
            blob = ciphertexts[sender]
            if not isinstance(blob, bytes) or len(blob) <= NONCE_BYTES:
                raise SecAggError(f"ciphertext from {sender!r} must be bytes longer than the nonce")
            try:
                plaintext = self._share_key(sender).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:],
                                                            share_aad(self.context, sender, self.client_id))
            except InvalidTag as error:
                raise SecAggError(f"ciphertext from {sender!r} does not decrypt") from error
            claimed_sender, claimed_recipient, b_share, s_share = _parse_share_plaintext(plaintext)
            if (claimed_sender, claimed_recipient) != (sender, self.client_id):
                raise SecAggError(f"ciphertext from {sender!r} names {claimed_sender!r} -> {claimed_recipient!r}")
            self._held_b[sender], self._held_s[sender] = b_share, s_share
        self.shared_with = frozenset(self._held_b)
        if len(self.shared_with) < self.context.threshold:
            raise SecAggError(f"{self.client_id}: only {len(self.shared_with)} neighbours shared keys, "
                              f"threshold is {self.context.threshold}")

    def mask(self, update: np.ndarray) -> np.ndarray:
        """update + PRG(b) + sum over U2 of +-PRG(s_uv), mod 2**32."""
        if not isinstance(update, np.ndarray) or update.dtype != np.uint32 or update.shape != (
                self.context.vector_length,):
            raise SecAggError(f"update must be a uint32 vector of length {self.context.vector_length}")
        self._enter("mask")
        masks = [(self._self_seed, False)]
        for peer in sorted(self.shared_with):
            seed = pairwise_seed(self._s_private, self._peer_adverts[peer].s_public, self.context.bytes())
            masks.append((seed, self.client_id > peer))  # sign rule: the smaller id adds the pairwise mask
        masked = update.copy()
        add_masks(masked, masks)
        return masked

    def confirm(self, survivors: Collection[str]) -> SurvivorSignature:
        """This device's identity signature on the round's survivor set, given once.

        Refused (Inconsistent) when the set leaves this device out (its masked vector went up:
        it is asked because it survived), names a non-participant, or names as a survivor a
        neighbour whose shares never reached this device (a survivor shared keys with every
        advertised neighbour: the server withheld them).
        """
        self._enter("confirm")
        claimed = frozenset(survivors)
        if self.client_id not in claimed:
            raise Inconsistent(f"the survivor set leaves out {self.client_id!r}, which is asked to confirm it")
        strangers = claimed - set(self.context.participants)
        if strangers:
            raise Inconsistent(f"the survivor set names {sorted(strangers)[0]!r}, which is not a participant")
        withheld = (claimed & self.neighbours) - self.shared_with - {self.client_id}
        if withheld:
            raise Inconsistent(f"the survivor set names {sorted(withheld)[0]!r}, whose shares were withheld from "
                               f"{self.client_id!r}")
        self.signed = claimed
        payload = survivors_payload(self.context, self.client_id, survivor_set_bytes(claimed))
        return SurvivorSignature(self.client_id, self.identity.sign(payload))

    def unmask(self, survivors: Collection[str], dropped: Collection[str],
               signatures: Mapping[str, bytes]) -> UnmaskResponse:
        """Shares of b for each neighbour in U2 that survived and of s_sk for each that dropped.

        Answered once per round: the request is consumed before it is checked, so a second call
        raises even after a refused first one. Refused (Inconsistent), revealing nothing, unless
        `survivors` is the set this device signed, `dropped` names exactly the neighbours in U2
        outside it, and at least `threshold` of this device's neighbours signed that same set
        (`signatures`: id -> signature; a bad one from a neighbour is refused, naming it). With
        threshold > degree/2 and every device signing once, no two sets each signed by
        `threshold` of one device's neighbours can both be acted on, so the server never gets a
        device's self-mask seed together with the mask keys of all those it masked with
        (consistency.py), nor its b and s key both.
        """
        self._enter("unmask")
        survivors, dropped = frozenset(survivors), frozenset(dropped)
        if self.signed is None:
            raise Inconsistent(f"{self.client_id!r} signed no survivor set this round")
        if survivors != self.signed:
            odd = sorted(survivors ^ self.signed)[0]
            raise Inconsistent(f"the unmask request's survivor set differs from the one {self.client_id!r} signed "
                               f"(on {odd!r})")
        both = survivors & dropped
        if both:
            raise Inconsistent(f"unmask request names {sorted(both)[0]!r} as both survivor and dropped")
        lost = self.shared_with - survivors
        if dropped & self.neighbours != lost:
            odd = sorted((dropped & self.neighbours) ^ lost)[0]
            raise Inconsistent(f"unmask request {'names' if odd in dropped else 'leaves out'} {odd!r} as dropped; "
                               f"the survivor set says otherwise")
        signed_set = survivor_set_bytes(survivors)
        payload = {peer: survivors_payload(self.context, peer, signed_set)
                   for peer in self.neighbours & set(signatures)}
        for peer in sorted(payload):
            try:
                self.roster.verify(peer, payload[peer], signatures[peer])
            except SecAggError as error:
                raise Inconsistent(f"the signature of {peer!r} on the survivor set does not verify") from error
        if len(payload) < self.context.threshold:
            raise Inconsistent(f"{len(payload)} neighbours of {self.client_id!r} signed the survivor set, "
                               f"threshold is {self.context.threshold}")
        b_shares = {peer: self._held_b[peer] for peer in self.shared_with & survivors}
        s_shares = {peer: self._held_s[peer] for peer in lost}
        self._held_b, self._held_s, self._self_seed = {}, {}, b""
        return UnmaskResponse(self.client_id, b_shares, s_shares)
