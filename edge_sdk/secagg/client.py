"""One device's side of a secure-aggregation round (SecAgg+): keys, shares, masking, unmasking.

A `SecAggClient` lives for one round and walks its stages in order, each exactly once:
advertise -> share_keys -> receive_shares -> mask -> unmask. Each stage returns what the device
sends next. Any violation (a bad signature, a ciphertext that does not decrypt, a stage out of
order, an inconsistent unmask request) raises SecAggError naming the field or device; the device
then sends nothing more this round, which the server sees as a dropout.
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

from .context import RoundContext, canonical
from .errors import SecAggError
from .identity import IdentityKey, Roster
from .masks import SEED_BYTES, add_masks, derive_key, pairwise_seed, private_raw, public_raw, shared_secret
from .messages import NONCE_BYTES, KeyAdvertisement, UnmaskResponse
from .shamir import SHARE_BYTES, split

SHARE_KEY_INFO = b"edgepfl-secagg-share"
_STAGES = ("advertise", "share_keys", "receive_shares", "mask", "unmask", "done")


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
        self.client_id = client_id
        self.identity = identity
        self.roster = roster
        self.context = context
        self.neighbours = context.neighbours_of(client_id)
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

        Verifies every advertised neighbour's signature against the roster (a substituted key fails
        here, naming the device); neighbours absent from `adverts` dropped out.
        """
        self._enter("share_keys")
        own = adverts.get(self.client_id)
        if own is not None and own != self._own_advert:
            raise SecAggError(f"the advertisement forwarded as {self.client_id!r}'s is not the one it sent")
        for peer in sorted(self.neighbours & set(adverts)):
            advert = adverts[peer]
            if not isinstance(advert, KeyAdvertisement) or advert.client_id != peer:
                raise SecAggError(f"advertisement listed under {peer!r} is not {peer!r}'s")
            payload = KeyAdvertisement.signed_payload(self.context, peer, advert.c_public, advert.s_public)
            self.roster.verify(peer, payload, advert.signature)
            self._peer_adverts[peer] = advert
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

    def unmask(self, survivors: Collection[str], dropped: Collection[str]) -> UnmaskResponse:
        """Shares of b for each surviving neighbour and of s_sk for each dropped one.

        Answered once per round: the request is consumed before it is checked, so a second call
        raises even after a refused first one. Refused, revealing nothing, when the sets overlap,
        name anyone outside U2 (the neighbours whose shares this device holds), or fewer than
        `threshold` of this device's neighbours survived (itself not counted). Together with
        threshold > degree/2 this means the server never gets both secrets of one device.
        """
        self._enter("unmask")
        survivors, dropped = frozenset(survivors), frozenset(dropped)
        both = survivors & dropped
        if both:
            raise SecAggError(f"unmask request names {sorted(both)[0]!r} as both survivor and dropped")
        unknown = (survivors | dropped) - self.shared_with
        if unknown:
            raise SecAggError(f"unmask request names {sorted(unknown)[0]!r}, which is not a neighbour that shared keys")
        if len(survivors) < self.context.threshold:
            raise SecAggError(f"unmask request has {len(survivors)} surviving neighbours, "
                              f"threshold is {self.context.threshold}")
        b_shares = {peer: self._held_b[peer] for peer in survivors}
        s_shares = {peer: self._held_s[peer] for peer in dropped}
        self._held_b, self._held_s, self._self_seed = {}, {}, b""
        return UnmaskResponse(self.client_id, b_shares, s_shares)
