"""The server's side of a secure-aggregation round (SecAgg+): relay messages, then unmask the sum.

The server sees only public keys, ciphertexts it cannot open, masked vectors and, at the end,
the shares it needs to remove the masks: the self-mask seed b_u of each survivor and the mask
private key of each device that dropped after sharing keys. It learns the sum of the survivors'
inputs and nothing else about them.

Stages close in order; calling a later stage's method closes the earlier ones:
  add_advertisement* -> advertisements (U1: who advertised; fixes the graph seed)
  route*             -> inbox          (U2: who sent shares to all its advertised neighbours)
  add_masked*        -> survivor_set   (U3: whose masked vector arrived; dropped = U2 - U3)
  (add_masked_sum: the masked vectors of several devices at once, summed by a shard's aggregator)
  add_signature*     -> unmask_request (U4: the survivors that signed U3)
  add_unmask_response* -> result
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from .consistency import graph_seed, survivor_set_bytes, survivors_payload
from .context import RoundContext
from .errors import RoundFailed, SecAggError
from .identity import Roster
from .masks import add_masks, pairwise_seed, public_raw
from .messages import EncryptedShares, KeyAdvertisement, MaskedInput, SurvivorSignature, UnmaskRequest, UnmaskResponse
from .shamir import combine

log = logging.getLogger(__name__)

_STAGES = ("advertising", "sharing", "masking", "confirming", "unmasking")
_SECRET_NAMES = {"b": "self-mask seed", "s": "mask key"}


class SecAggServer:
    """The server's state for one round; see the module docstring for the stage order."""

    def __init__(self, context: RoundContext, roster: Roster | None = None) -> None:
        """`context` is the announced one (no graph seed: the advertisements fix it). With a roster,
        advertisements and survivor signatures are checked on arrival (devices check them regardless)."""
        if context.graph_seed is not None:
            raise SecAggError("the round context must come without a graph seed: it is derived from the advertisements")
        self.context = context
        self.roster = roster
        self._stage = 0
        self._adverts: dict[str, KeyAdvertisement] = {}
        self._routed: dict[str, dict[str, bytes]] = {}  # recipient -> sender -> ciphertext
        self._shared: set[str] = set()
        self._survivors: set[str] = set()
        self._masked_sum = np.zeros(context.vector_length, dtype=np.uint32)
        """The survivors' masked vectors added up as they arrive: the sum is all unmasking needs."""
        self._signatures: dict[str, bytes] = {}
        self._responses: dict[str, UnmaskResponse] = {}
        self._result: np.ndarray | None = None

    def _enter(self, stage: str, action: str) -> None:
        index = _STAGES.index(stage)
        if index < self._stage:
            raise SecAggError(f"{action}: the {stage} stage is closed (now {_STAGES[self._stage]})")
        if index > self._stage:
            log.debug("secagg round %s: %s stage closed by %s", self.context.round, _STAGES[self._stage], action)
        self._stage = index

    def _participant(self, client_id: str) -> frozenset[str]:
        return self.context.neighbours_of(client_id)

    def _check_participant(self, client_id: str) -> None:
        if client_id not in self.context.participants:
            raise SecAggError(f"{client_id!r} is not a participant of this round")

    @property
    def advertised(self) -> frozenset[str]:
        """U1: the devices whose key advertisements were accepted."""
        return frozenset(self._adverts)

    @property
    def shared(self) -> frozenset[str]:
        """U2: the devices that sent their shares to every advertised neighbour."""
        return frozenset(self._shared)

    @property
    def survivors(self) -> frozenset[str]:
        """U3: the devices whose masked vector arrived (final once unmasking began)."""
        return frozenset(self._survivors)

    @property
    def dropped(self) -> frozenset[str]:
        """U2 - U3: devices that shared keys but whose masked vector did not arrive."""
        return self.shared - self.survivors

    def add_advertisement(self, advert: KeyAdvertisement) -> None:
        """Accept a device's key advertisement (once per device)."""
        self._enter("advertising", "add_advertisement")
        self._check_participant(advert.client_id)
        if advert.client_id in self._adverts:
            raise SecAggError(f"{advert.client_id!r} already advertised keys this round")
        if self.roster is not None:
            payload = KeyAdvertisement.signed_payload(self.context, advert.client_id, advert.c_public,
                                                      advert.s_public)
            self.roster.verify(advert.client_id, payload, advert.signature)
        self._adverts[advert.client_id] = advert

    def advertisements(self) -> dict[str, KeyAdvertisement]:
        """Every accepted advertisement, as forwarded to all devices; closes the advertising stage
        and derives the graph seed from them, as every device does."""
        self._enter("sharing", "advertisements")
        self._fix_seed()
        return dict(self._adverts)

    def _fix_seed(self) -> None:
        if self.context.graph_seed is None:
            self.context = self.context.with_graph_seed(graph_seed(self.context, self._adverts))

    def route(self, sender: str, ciphertexts: Mapping[str, bytes]) -> dict[str, bytes]:
        """Accept `sender`'s share ciphertexts and return them by recipient.

        They must be addressed to exactly the sender's advertised neighbours: a device that left
        one out would mask against a peer that does not mask against it.
        """
        self._enter("sharing", "route")
        self._fix_seed()
        if sender not in self._adverts:
            raise SecAggError(f"shares from {sender!r}, which did not advertise keys")
        if sender in self._shared:
            raise SecAggError(f"{sender!r} already sent its shares this round")
        bundle = EncryptedShares(sender, ciphertexts)
        expected = self._participant(sender) & self.advertised
        if set(bundle.ciphertexts) != expected:
            odd = sorted(set(bundle.ciphertexts) ^ expected)
            raise SecAggError(f"shares from {sender!r} must address exactly its advertised neighbours; "
                              f"{odd[0]!r} is {'missing' if odd[0] in expected else 'not one'}")
        for recipient, ciphertext in bundle.ciphertexts.items():
            self._routed.setdefault(recipient, {})[sender] = ciphertext
        self._shared.add(sender)
        return dict(bundle.ciphertexts)

    def inbox(self, recipient: str) -> dict[str, bytes]:
        """Sender -> ciphertext of every share routed to `recipient`; closes the sharing stage."""
        self._enter("masking", "inbox")
        self._participant(recipient)
        return dict(self._routed.get(recipient, {}))

    def add_masked(self, sender: str, vector: np.ndarray) -> None:
        """Accept `sender`'s masked vector: a uint32 vector of the round's length, once per device."""
        self._enter("masking", "add_masked")
        if sender not in self._shared:
            raise SecAggError(f"masked vector from {sender!r}, which did not share keys")
        if sender in self._survivors:
            raise SecAggError(f"{sender!r} already sent its masked vector")
        masked = MaskedInput(sender, vector).vector
        if masked.shape != (self.context.vector_length,):
            raise SecAggError(f"masked vector from {sender!r} has length {masked.size}, "
                              f"expected {self.context.vector_length}")
        self._masked_sum += masked
        self._survivors.add(sender)

    def add_masked_sum(self, senders: list[str], total: np.ndarray) -> None:
        """Accept the sum of `senders`' masked vectors, added up by another party (a shard's
        aggregator): each sender counts as a survivor, as if its vector had come here."""
        self._enter("masking", "add_masked_sum")
        strangers = [s for s in senders if s not in self._shared]
        if strangers:
            raise SecAggError(f"masked sum over {strangers[0]!r}, which did not share keys")
        repeated = [s for s in senders if s in self._survivors]
        if repeated or len(set(senders)) != len(senders):
            raise SecAggError(f"masked sum over {(repeated or senders)[0]!r}, whose vector is already summed")
        if not senders:
            raise SecAggError("a masked sum over no device")
        length = self.context.vector_length
        if not isinstance(total, np.ndarray) or total.dtype != np.uint32 or total.shape != (length,):
            raise SecAggError(f"a masked sum must be a uint32 vector of length {length}")
        self._masked_sum += total
        self._survivors.update(senders)

    def survivor_set(self) -> tuple[str, ...]:
        """U3, sorted, as every survivor is asked to sign it; closes the masking stage, fixing U3."""
        self._enter("confirming", "survivor_set")
        return tuple(sorted(self._survivors))

    def add_signature(self, signature: SurvivorSignature) -> None:
        """Accept a survivor's signature on U3 (once per survivor)."""
        self._enter("confirming", "add_signature")
        signer = signature.client_id
        if signer not in self._survivors:
            raise SecAggError(f"a survivor signature from {signer!r}, which is not a survivor")
        if signer in self._signatures:
            raise SecAggError(f"{signer!r} already signed the survivor set")
        if self.roster is not None:
            payload = survivors_payload(self.context, signer, survivor_set_bytes(self._survivors))
            self.roster.verify(signer, payload, signature.signature)
        self._signatures[signer] = signature.signature

    @property
    def signers(self) -> frozenset[str]:
        """U4: the survivors whose signature on U3 was accepted."""
        return frozenset(self._signatures)

    def signatures(self) -> dict[str, bytes]:
        """Signer -> its signature on U3, as the unmask stage forwards them to every signer."""
        return dict(sorted(self._signatures.items()))

    def unmask_request(self, client_id: str) -> UnmaskRequest:
        """What `client_id` (a survivor that signed U3) is asked to unmask: U3, U2 - U3 and the
        signatures of its neighbours; closes the confirming stage."""
        self._enter("unmasking", "unmask_request")
        if client_id not in self._signatures:
            raise SecAggError(f"{client_id!r} did not sign the survivor set; it gets no unmask request")
        signed = {peer: self._signatures[peer] for peer in sorted(self._participant(client_id) & self.signers)}
        return UnmaskRequest(tuple(self._survivors), tuple(self.dropped), signed)

    def add_unmask_response(self, response: UnmaskResponse) -> None:
        """Accept a survivor's shares: b of its neighbours in U3, s of those in U2 - U3."""
        self._enter("unmasking", "add_unmask_response")
        sender = response.client_id
        if sender not in self._signatures:
            raise SecAggError(f"unmask response from {sender!r}, which did not sign the survivor set")
        if sender in self._responses:
            raise SecAggError(f"{sender!r} already answered its unmask request")
        shared_neighbours = self._participant(sender) & self.shared
        if (set(response.b_shares) != shared_neighbours & self.survivors
                or set(response.s_shares) != shared_neighbours - self.survivors):
            raise SecAggError(f"unmask response from {sender!r} does not answer its request")
        self._responses[sender] = response

    def _shares_of(self, owner: str, kind: str) -> dict[int, bytes]:
        """x -> share of `owner`'s secret of `kind` ("b": self-mask seed, "s": mask key) that arrived."""
        found = {}
        for holder, response in self._responses.items():
            revealed = response.b_shares if kind == "b" else response.s_shares
            if owner in revealed:
                found[self.context.share_x(holder)] = revealed[owner]
        return found

    def _rebuild(self, owner: str, kind: str, shares: dict[int, bytes]) -> bytes:
        """combine() over the first threshold shares, checked against the last threshold when more arrived."""
        threshold = self.context.threshold
        secret = combine(shares, threshold)
        if len(shares) > threshold and combine({x: shares[x] for x in sorted(shares)[-threshold:]},
                                               threshold) != secret:
            raise SecAggError(f"shares of {owner!r}'s {_SECRET_NAMES[kind]} are inconsistent")
        return secret

    def result(self) -> np.ndarray:
        """The sum mod 2**32 of the survivors' inputs. RoundFailed, before anything is rebuilt, when
        fewer than threshold shares of some needed secret arrived."""
        if self._result is not None:
            return self._result.copy()
        self._enter("unmasking", "result")
        survivors = sorted(self.survivors)
        if not survivors:
            raise RoundFailed("no masked vector arrived")
        needed = [(owner, "b") for owner in survivors]
        needed += [(owner, "s") for owner in sorted(self.dropped) if self._participant(owner) & self.survivors]
        shares = {(owner, kind): self._shares_of(owner, kind) for owner, kind in needed}
        short = []
        for (owner, kind), got in shares.items():
            if len(got) < self.context.threshold:
                short.append(f"{owner} ({_SECRET_NAMES[kind]}: {len(got)} of {self.context.threshold} shares)")
        if short:
            raise RoundFailed("too few shares to unmask: " + ", ".join(short))
        masks = [(self._rebuild(owner, "b", shares[owner, "b"]), True) for owner in survivors]
        context_bytes = self.context.bytes()
        for owner, kind in needed:
            if kind == "s":
                masks += self._pairwise_masks(owner, self._rebuild(owner, "s", shares[owner, "s"]), context_bytes)
        total = self._masked_sum
        add_masks(total, masks)
        self._result = total
        return total.copy()

    def _pairwise_masks(self, dropped: str, private: bytes, context_bytes: bytes) -> list[tuple[bytes, bool]]:
        """(seed, subtract) of the pairwise masks the survivors added against the dropped device
        `dropped`: what takes them off the sum."""
        s_private = X25519PrivateKey.from_private_bytes(private)
        if public_raw(s_private) != self._adverts[dropped].s_public:
            raise SecAggError(f"shares of {dropped!r}'s mask key rebuild a key it did not advertise")
        # the survivor with the smaller id added it (take it off), the larger subtracted it
        return [(pairwise_seed(s_private, self._adverts[survivor].s_public, context_bytes), survivor < dropped)
                for survivor in sorted(self._participant(dropped) & self.survivors)]
