"""A trainer's side of secure aggregation over the protocol: one `SecAggClient` per round, driven
by the coordinator's SECAGG stages, and the masked upload that replaces the plain TRAIN_RES.

The device trains when TRAIN arrives, as in any round; what it uploads is its change as one
vector (vector.py: clipped to the round's bound, scaled by its weight; under distributed DP as DP
clipped and noised it, unweighted), quantized into the ring (fixedpoint.py) and masked
(client.py). Masking needs the shares its neighbours sent (the `shares` delivery), which may
arrive after TRAIN: the trained vector then waits for them. A release pool's share (pools.py)
goes the same way, in the EVAL_RES that answers the pool's EVALUATE.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..params import spec_of
from ..protocol import PROTOTYPES, STATISTICS, ArrayGroup, Envelope, ProtocolError, Reason
from . import stages
from .client import SecAggClient
from .context import RoundContext
from .errors import Inconsistent, SecAggError
from .fixedpoint import FixedPoint
from .identity import IdentityKey, Roster
from .messages import EncryptedShares, KeyAdvertisement
from .pools import encode_prototypes, encode_statistics
from .vector import VectorLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SecAggKeys:
    """A device's long-term identity key and the roster of every device's public identity key:
    what lets its neighbours, and it, detect a key the coordinator substituted."""

    identity: IdentityKey
    roster: Roster

    @classmethod
    def load(cls, identity: str | Path, roster: str | Path) -> SecAggKeys:
        """From the identity key file (64 hex digits) and the roster (JSON) `edgepfl secagg-keys` wrote."""
        return cls(IdentityKey.from_hex(Path(identity).read_text(encoding="utf-8").strip()), Roster.load(roster))


def _malformed(detail: str) -> ProtocolError:
    return ProtocolError(Reason.MALFORMED, detail)


@dataclass
class PendingUpload:
    """A ring vector waiting for the neighbours' shares to be masked: a trained round's (answered
    with TRAIN_RES) or a release pool's share (answered with EVAL_RES, `metrics` and `config` beside it)."""

    request: Envelope
    vector: np.ndarray
    metrics: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MaskedReply:
    """What a device sends once its vector is masked: the reply to `request`, whose groups carry
    only the masked vector."""

    request: Envelope
    groups: dict[str, ArrayGroup]
    metrics: dict[str, float]
    config: dict[str, Any]


class SecureUploads:
    """The device's secure-aggregation state: the round's client, and an upload waiting for shares."""

    def __init__(self, client_id: str, keys: SecAggKeys, examples: int, rng: np.random.Generator | None = None):
        self.client_id = client_id
        self.keys = keys
        self.examples = examples
        self.rng = rng or np.random.default_rng()
        self._round: tuple[str, int] | None = None  # (run, round) of `_client`
        self._client: SecAggClient | None = None
        self._announced: dict[str, Any] = {}
        self._shares_received = False
        self.pending: PendingUpload | None = None

    def on_stage(self, envelope: Envelope) -> dict[str, Any] | None:
        """Act on a SECAGG stage; the config of the SECAGG_RES to send, or None (no answer: a
        delivery, or a round this device does not take part in). ProtocolError on a malformed
        stage; SecAggError when the stage must not be answered (the device drops out of the round),
        Inconsistent when it contradicts what this device knows or signed (it refuses, saying why)."""
        stage = envelope.config.get(stages.STAGE)
        if stage == stages.ADVERTISE:
            return self._advertise(envelope)
        client = self._client_of(envelope)
        if client is None:
            return None
        if stage == stages.SHARE:
            adverts = envelope.config.get(stages.ADVERTS)
            if not isinstance(adverts, dict):
                raise _malformed("a SECAGG share stage carries the advertisements as a map")
            group = set(client.context.participants)  # a sharded run forwards every group's
            parsed = {peer: KeyAdvertisement.from_wire(advert) for peer, advert in adverts.items() if peer in group}
            return {stages.CIPHERTEXTS: client.share_keys(parsed)}
        if stage == stages.SHARES:
            if self._shares_received:  # delivered again (QoS 1): already taken
                return None
            shares = EncryptedShares.from_wire({"client_id": self.client_id,
                                                "ciphertexts": envelope.config.get(stages.CIPHERTEXTS)})
            client.receive_shares(shares.ciphertexts)
            self._shares_received = True
            return None
        if stage == stages.CONFIRM:
            return {stages.SIGNATURE: client.confirm(self._group_ids(client, envelope, stages.SURVIVORS)).signature}
        if stage == stages.UNMASK:
            signatures = envelope.config.get(stages.SIGNATURES)
            if not isinstance(signatures, dict):
                raise _malformed("a SECAGG unmask stage carries the signatures as a map")
            group = set(client.context.participants)
            signed = {peer: bytes(value) if isinstance(value, memoryview) else value
                      for peer, value in signatures.items() if peer in group}
            response = client.unmask(self._group_ids(client, envelope, stages.SURVIVORS),
                                     self._group_ids(client, envelope, stages.DROPPED),
                                     signed)
            return {stages.RESPONSE: response.to_wire()}
        raise _malformed(f"unknown SECAGG stage {stage!r}")

    @staticmethod
    def _group_ids(client: SecAggClient, envelope: Envelope, key: str) -> list[str]:
        """The ids a stage lists under `key` that belong to the client's group (a sharded run lists every group's)."""
        ids = envelope.config.get(key)
        if not isinstance(ids, list):
            raise _malformed(f"a SECAGG {envelope.config.get(stages.STAGE)} stage carries {key} as a list")
        group = set(client.context.participants)
        return [device for device in ids if device in group]

    def _advertise(self, envelope: Envelope) -> dict[str, Any] | None:
        config = self._own_group(envelope.config)
        if config is None:
            return None
        if stages.GRAPH_SEED in config:
            raise Inconsistent("the advertise stage names a graph seed: the coordinator would choose this device's "
                               "neighbours (each device derives the seed from the advertisements)")
        participants = config[stages.PARTICIPANTS]
        try:
            context = RoundContext(envelope.run_id, envelope.round, tuple(participants), config[stages.THRESHOLD],
                                   config[stages.DEGREE], None, config[stages.LENGTH])
        except (KeyError, SecAggError) as exc:
            raise _malformed(f"a SECAGG advertise stage: {exc}") from None
        self._round, self._announced = (envelope.run_id, envelope.round), config
        self._client = SecAggClient(self.client_id, self.keys.identity, self.keys.roster, context)
        self._shares_received, self.pending = False, None
        return {stages.ADVERT: self._client.advertise().to_wire()}

    def _own_group(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """The advertise stage's parameters of the group this device is a participant of: the
        stage's own (one group), or one of its `groups` (a sharded run: a group per shard); None
        when it names this device in none."""
        groups = config.get(stages.GROUPS, [config])
        if not isinstance(groups, list):
            raise _malformed("a SECAGG advertise stage carries its groups as a list")
        for group in groups:
            participants = group.get(stages.PARTICIPANTS) if isinstance(group, dict) else None
            if isinstance(participants, list) and self.client_id in participants:
                return group
        return None

    def _client_of(self, envelope: Envelope) -> SecAggClient | None:
        """The round's client, if this device advertised keys for the round `envelope` belongs to."""
        return self._client if self._round == (envelope.run_id, envelope.round) else None

    def vector(self, request: Envelope, groups: dict[str, ArrayGroup]) -> None:
        """Turn a trained upload of the round `request` (TRAIN, whose groups came down) into its
        ring vector and keep it until it can be masked (`ready`)."""
        client = self._keyed_client(request, "TRAIN")
        try:
            clip, largest, summands = (self._announced[key] for key in (stages.CLIP, stages.LARGEST,
                                                                       stages.SUMMANDS))
            layout = VectorLayout({group: spec_of(arrays) for group, arrays in groups.items()})
            if self._announced.get(stages.PRIVATE) is True:  # clipped and noised by DP: unweighted, as it is
                values = layout.encode(groups, request.groups, math.inf, 1.0)
                quantizer = FixedPoint(float(clip), int(summands))
            else:
                values = layout.encode(groups, request.groups, float(clip), min(1.0, self.examples / largest))
                quantizer = FixedPoint(max(float(clip), 1.0), int(summands))
            ring = quantizer.encode(values, self.rng)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise _malformed(f"secure upload of round {request.round}: {exc}") from None
        self._keep(client, PendingUpload(request, ring))

    def pool_share(self, request: Envelope, arrays: ArrayGroup, metrics: dict[str, float],
                   config: dict[str, Any] | None = None) -> None:
        """Turn this device's share of the release pool the advertise stage named (an EVALUATE of
        that pool's phase) into its ring vector and keep it, with the EVAL_RES's `metrics` and
        `config`, until it can be masked (`ready`). SecAggError for a share this device must not
        send (not finite, counts above the stage's largest): it drops out of the pool."""
        client = self._keyed_client(request, "a release pool's EVALUATE")
        announced = self._announced
        try:
            pool, bound, largest, summands = (announced[key] for key in (stages.POOL, stages.BOUND, stages.LARGEST,
                                                                          stages.SUMMANDS))
            bound, largest = float(bound), int(largest)
            if pool == STATISTICS:
                values = encode_statistics(arrays, self.examples, largest, bound)
            elif pool == PROTOTYPES:
                values = encode_prototypes(arrays["counts"], arrays["means"], largest, bound)
            else:
                raise ValueError(f"unknown pool {pool!r}")
            ring = FixedPoint(max(bound, 1.0), int(summands)).encode(values, self.rng)
        except (KeyError, TypeError) as exc:
            raise _malformed(f"secure pool share of round {request.round}: {exc}") from None
        except ValueError as exc:
            raise SecAggError(f"{self.client_id}: its share of the {announced.get(stages.POOL)} pool: {exc}") from None
        self._keep(client, PendingUpload(request, ring, metrics, config or {}))

    def _keyed_client(self, request: Envelope, what: str) -> SecAggClient:
        client = self._client_of(request)
        if client is None:
            raise SecAggError(f"{self.client_id}: {what} of round {request.round} under secure aggregation, but this "
                              "device advertised no keys for it")
        return client

    def _keep(self, client: SecAggClient, pending: PendingUpload) -> None:
        if pending.vector.size != client.context.vector_length:
            raise SecAggError(f"{self.client_id}: the vector has {pending.vector.size} elements, the announced "
                              f"length is {client.context.vector_length}")
        self.pending = pending

    def ready(self) -> MaskedReply | None:
        """The reply to send once the pending vector can be masked, else None."""
        client = self._client_of(self.pending.request) if self.pending is not None else None
        if self.pending is None or client is None or not self._shares_received:
            return None
        pending, self.pending = self.pending, None
        masked = client.mask(pending.vector)
        return MaskedReply(pending.request, {stages.SECURE: {stages.MASKED: masked.view(np.int32)}}, pending.metrics,
                           pending.config)
