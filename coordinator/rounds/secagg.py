"""The coordinator's side of a round under secure aggregation: the stages' requests, what their
answers must be, and the survivors' sum as the partial sum an algorithm folds in.

The round's selected devices advertise keys, share their secrets with their neighbours (the
coordinator routes ciphertexts it cannot open), train and upload masked vectors, sign the
survivor set, and the signers reveal the shares that remove the masks of the sum
(edge_sdk/secagg). The coordinator chooses neither the graph (its seed comes from the
advertisements) nor what a device reveals (only for a survivor set its neighbours signed). What comes out
is the sum of weight x clipped change and the sum of the weights (edge_sdk/secagg/vector.py):
the partial sum a shard aggregator would send, folded in by the algorithm's `fold_partial`, so
any algorithm whose aggregation splits into partial sums runs under secure aggregation
unchanged. The coordinator never holds one device's update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_sdk.config import ConfigError
from edge_sdk.params import ArraySpec
from edge_sdk.privacy.secagg_settings import SecAggSettings
from edge_sdk.protocol import MAX_REFUSAL_DETAIL, ArrayGroup, ProtocolError, Reason
from edge_sdk.secagg import stages
from edge_sdk.secagg.context import RoundContext
from edge_sdk.secagg.errors import SecAggError
from edge_sdk.secagg.fixedpoint import FixedPoint
from edge_sdk.secagg.messages import KeyAdvertisement, SurvivorSignature, UnmaskResponse
from edge_sdk.secagg.server import SecAggServer
from edge_sdk.secagg.vector import VectorLayout

from ..aggregation.averaging import PartialSum

if TYPE_CHECKING:
    from ..algorithms.base import ServerAlgorithm
    from ..config.run_config import RunConfig

MIN_PARTICIPANTS = 3
"""Fewer devices in a round and the sum tells each of them the others' updates."""


@dataclass(frozen=True)
class SecurePool:
    """A release pool summed securely (edge_sdk/secagg/pools.py): its name, the length of each
    device's vector and the bound each coordinate is clipped to."""

    name: str
    length: int
    bound: float


def _refused(detail: str) -> ProtocolError:
    return ProtocolError(Reason.SECAGG_INVALID, detail)


class DeviceRefusal(ProtocolError):
    """A device's SECAGG_RES refusing its stage (`refused`, `detail`): the stage contradicted what
    the device knows or signed. Counted under its reason; the device is not NACKed (it said why)."""


@dataclass
class SecureRoundRecord:
    """How far a round's devices got through the stages (its `secagg` entry in metrics.jsonl)."""

    selected: int
    advertised: int = 0
    shared: int = 0
    masked: int = 0
    confirmed: int = 0
    """Survivors whose signature on the survivor set was taken."""
    unmasked: int = 0
    dropped: list[str] = field(default_factory=list)
    """Devices that shared keys but whose masked vector did not arrive: their masks were removed."""
    failed: str | None = None
    """Why the sum could not be unmasked (too few shares): nothing of the round was aggregated."""
    failed_groups: list[str] = field(default_factory=list)
    """In a sharded run whose other shards aggregated: each shard left out of the round, and why."""
    refused: list[str] = field(default_factory=list)
    """Each device that refused a stage as inconsistent (`secagg_inconsistent`): "<id> (<stage>): why"."""
    groups: list[int] = field(default_factory=list)
    """How many devices each group masked among, smallest first: the round's selected devices, or,
    sharded, each shard's (the figures of `report.secagg_report` are per group size)."""


class SecureRound:
    """One round's secure aggregation: `config(stage)` is what a stage's request carries,
    `on_reply(stage, sender, config)` and `on_masked(sender, groups)` take the devices' answers
    (ProtocolError `secagg_invalid` for one the round cannot take), `partial()` the result.

    With `pool`, the sum is a release pool's instead of a round's updates (`spec` unused): the
    devices' vectors are their shares (pools.py) and `pool_sum()` the result."""

    def __init__(self, settings: SecAggSettings, run_id: str, round_: int, selected: list[str],
                 spec: dict[str, ArraySpec], examples: dict[str, int], *,
                 private: tuple[float, float] | None = None, largest: int | None = None,
                 pool: SecurePool | None = None):
        participants = tuple(sorted(selected))
        if len(participants) < MIN_PARTICIPANTS:
            raise SecAggError(f"round {round_}: {len(participants)} devices selected; secure aggregation needs at "
                              f"least {MIN_PARTICIPANTS}")
        self.pool = pool
        self.layout = VectorLayout(spec if pool is None else {})
        degree = settings.degree_for(len(participants))
        self.context = RoundContext(run_id, round_, participants, settings.threshold_for(degree), degree, None,
                                    self.layout.length if pool is None else pool.length)
        """The announced context (no graph seed: `server.context` has the one the advertisements fix)."""
        self.server = SecAggServer(self.context)
        self.private = private
        """Under distributed DP: (each coordinate's bound, the fixed denominator); the devices upload
        their change clipped and noised by DP, unweighted, and the sum is divided by the denominator."""
        self.clip = pool.bound if pool is not None else settings.secagg_clip if private is None else private[0]
        self.largest = (largest or max(examples.values())) if private is None else 1
        """The weights' scale, n_i / largest: the same in every group of a round (`largest` of them all)."""
        self.quantizer = FixedPoint(max(self.clip, 1.0) if private is None else self.clip, len(participants))
        self.record = SecureRoundRecord(len(participants))

    # -- what the requests carry -----------------------------------------------------------
    def config(self, stage: str) -> dict[str, Any]:
        """The stage-specific part of a SECAGG request's config (advertise, share, confirm or unmask)."""
        context = self.context
        if stage == stages.ADVERTISE:
            return {stages.PARTICIPANTS: list(context.participants), stages.THRESHOLD: context.threshold,
                    stages.DEGREE: context.degree, stages.LENGTH: context.vector_length, stages.CLIP: self.clip,
                    stages.LARGEST: self.largest,
                    stages.SUMMANDS: len(context.participants), stages.PRIVATE: self.private is not None,
                    **({stages.POOL: self.pool.name, stages.BOUND: self.pool.bound} if self.pool is not None else {})}
        if stage == stages.SHARE:
            self.record.advertised = len(self.server.advertised)
            return {stages.ADVERTS: {peer: advert.to_wire() for peer, advert in
                                     self.server.advertisements().items()}}
        if stage == stages.CONFIRM:
            self.record.masked = len(self.server.survivors)
            self.record.dropped = sorted(self.server.dropped)
            return {stages.SURVIVORS: list(self.server.survivor_set())}
        if stage == stages.UNMASK:
            self.record.confirmed = len(self.server.signers)
            return {stages.SURVIVORS: sorted(self.server.survivors), stages.DROPPED: sorted(self.server.dropped),
                    stages.SIGNATURES: self.server.signatures()}
        raise ValueError(f"no request for the SECAGG stage {stage!r}")

    def deliveries(self) -> dict[str, dict[str, Any]]:
        """Per device that shared keys: the `shares` delivery's config, the ciphertexts addressed to it."""
        self.record.shared = len(self.server.shared)
        return {device: {stages.CIPHERTEXTS: self.server.inbox(device)} for device in sorted(self.server.shared)}

    # -- the devices' answers --------------------------------------------------------------
    def on_reply(self, stage: str, sender: str, config: dict[str, Any]) -> None:
        """Take one SECAGG_RES of `stage` from `sender`; DeviceRefusal when it refuses the stage."""
        if config.get(stages.STAGE) != stage:
            raise _refused(f"SECAGG_RES from {sender} answers stage {config.get(stages.STAGE)!r}, not {stage!r}")
        if stages.REFUSED in config:
            refusal = self._refusal(stage, sender, config)
            self.record.refused.append(refusal.detail)
            raise refusal
        try:
            if stage == stages.ADVERTISE:
                advert = KeyAdvertisement.from_wire(config.get(stages.ADVERT))
                if advert.client_id != sender:
                    raise SecAggError(f"the advertisement names {advert.client_id!r}")
                self.server.add_advertisement(advert)
            elif stage == stages.SHARE:
                self.server.route(sender, _plain_bytes(config.get(stages.CIPHERTEXTS)))
            elif stage == stages.CONFIRM:
                self.server.add_signature(SurvivorSignature.from_wire(
                    {"client_id": sender, "signature": _plain(config.get(stages.SIGNATURE))}))
            elif stage == stages.UNMASK:
                response = UnmaskResponse.from_wire(config.get(stages.RESPONSE))
                if response.client_id != sender:
                    raise SecAggError(f"the unmask response names {response.client_id!r}")
                self.server.add_unmask_response(response)
                self.record.unmasked += 1
        except SecAggError as exc:
            raise _refused(f"SECAGG_RES ({stage}) from {sender}: {exc}") from None

    @staticmethod
    def _refusal(stage: str, sender: str, config: dict[str, Any]) -> ProtocolError:
        """The refusal a SECAGG_RES with `refused` carries: DeviceRefusal under `secagg_inconsistent`,
        or `secagg_invalid` when its reason is another or its detail not text."""
        reason, detail = config.get(stages.REFUSED), config.get(stages.DETAIL)
        if (reason != Reason.SECAGG_INCONSISTENT.value or not isinstance(detail, str)
                or set(config) - {"in_reply_to"} != {stages.STAGE, stages.REFUSED, stages.DETAIL}):
            return _refused(f"SECAGG_RES ({stage}) from {sender}: a refusal carries {stages.REFUSED} = "
                            f"{Reason.SECAGG_INCONSISTENT.value!r} and a text {stages.DETAIL}, nothing else")
        return DeviceRefusal(Reason.SECAGG_INCONSISTENT, f"{sender} ({stage}): {detail[:MAX_REFUSAL_DETAIL]}")

    def on_masked(self, sender: str, groups: dict[str, ArrayGroup]) -> None:
        """Take `sender`'s masked vector (its TRAIN_RES carries nothing else)."""
        try:
            self.server.add_masked(sender, stages.masked_vector(groups, f"update from {sender}"))
        except SecAggError as exc:
            raise _refused(f"update from {sender}: {exc}") from None

    def on_masked_sum(self, shard: int, senders: list[str], total: np.ndarray) -> None:
        """Take shard `shard`'s masked sum over `senders` (its aggregator added their vectors up)."""
        try:
            self.server.add_masked_sum(senders, total)
        except SecAggError as exc:
            raise _refused(f"masked sum of shard {shard}: {exc}") from None

    # -- the result ------------------------------------------------------------------------
    def pool_sum(self) -> np.ndarray:
        """A release pool's sum over the survivors (float64). RoundFailed when it cannot be unmasked."""
        return self.quantizer.decode_sum(self.server.result())

    def partial(self, share: float = 1.0) -> dict[str, PartialSum]:
        """The survivors' sum, by group, as the partial sum `fold_partial` takes. RoundFailed
        (edge_sdk.secagg) when too few shares arrived to unmask it. Under distributed DP its
        weight is `share` of the fixed denominator: the shares of a round's shards add up to 1."""
        sums, total_weight = self.layout.decode(self.quantizer.decode_sum(self.server.result()))
        count = len(self.server.survivors)
        weight = total_weight if self.private is None else share * self.private[1]
        return {group: PartialSum(arrays, weight, count) for group, arrays in sums.items()}


class SecureGroups:
    """A round's secure aggregation over groups of devices that each mask among themselves and
    are unmasked on their own: the whole round (one group, `sharded` False), or each shard of a
    sharded run.

    Each stage is one broadcast for every group: `config(stage)` carries the one group's
    parameters as they are, or a group per shard under `groups` (advertise); the share stage
    carries every group's advertisements and the unmask stage every group's survivors and
    dropped devices (a device takes those of its neighbours). Answers go to the sender's group.
    A group that cannot go on (too few devices to hide each other, too few shares) is dropped
    with its reason; the others go on."""

    def __init__(self, round_: int, rounds: dict[int, SecureRound], selected: int, *, sharded: bool):
        self.round = round_
        self.rounds = dict(rounds)
        """The groups still in the round."""
        self._all = dict(rounds)
        self.group_of = {device: group for group, secure in rounds.items() for device in secure.context.participants}
        self.failed: list[str] = []
        self.selected, self.sharded = selected, sharded

    def drop(self, group: int, why: str) -> None:
        """Leave `group` out of the rest of the round, for `why`."""
        self.rounds.pop(group, None)
        self.failed.append(f"shard {group}: {why}" if self.sharded else why)

    def config(self, stage: str) -> dict[str, Any]:
        """The stage-specific part of a SECAGG request's config, for every group."""
        configs = [secure.config(stage) for _, secure in sorted(self.rounds.items())]
        if not self.sharded:
            return configs[0]
        if stage == stages.ADVERTISE:
            return {stages.GROUPS: configs}
        if stage == stages.SHARE:
            return {stages.ADVERTS: {peer: advert for c in configs for peer, advert in c[stages.ADVERTS].items()}}
        merged: dict[str, Any] = {key: sorted(device for c in configs for device in c[key])
                                  for key in (stages.SURVIVORS, stages.DROPPED) if key in configs[0]}
        if stage == stages.UNMASK:
            merged[stages.SIGNATURES] = {peer: sig for c in configs for peer, sig in c[stages.SIGNATURES].items()}
        return merged

    def on_reply(self, stage: str, sender: str, config: dict[str, Any]) -> None:
        """Take one SECAGG_RES of `stage` from `sender`, for its group."""
        group = self.group_of.get(sender)
        if group is None or group not in self.rounds:
            raise _refused(f"SECAGG_RES ({stage}) from {sender}, which is in no group of the round")
        self.rounds[group].on_reply(stage, sender, config)

    def deliveries(self) -> dict[str, dict[str, Any]]:
        """Per device that shared keys: the `shares` delivery's config (its group's ciphertexts to it)."""
        return {device: delivery for secure in self.rounds.values() for device, delivery in secure.deliveries().items()}

    def record(self) -> SecureRoundRecord:
        """The round's record: every group's stages added up; `failed` when no group is left."""
        records = [secure.record for secure in self._all.values()]
        return SecureRoundRecord(
            self.selected, advertised=sum(r.advertised for r in records), shared=sum(r.shared for r in records),
            masked=sum(r.masked for r in records), confirmed=sum(r.confirmed for r in records),
            unmasked=sum(r.unmasked for r in records), refused=[d for r in records for d in r.refused],
            dropped=sorted(d for r in records for d in r.dropped),
            failed="; ".join(self.failed) if self.failed and not self.rounds else None,
            failed_groups=list(self.failed) if self.rounds else [],
            groups=sorted(r.selected for r in records))


def _plain(value: Any) -> Any:
    """`value`, a memoryview (a long bin decodes as a view of the message) made bytes."""
    return bytes(value) if isinstance(value, memoryview) else value


def _plain_bytes(ciphertexts: Any) -> dict[str, bytes]:
    """The ciphertexts map with memoryviews (long bins decode as views of the message) as bytes."""
    if not isinstance(ciphertexts, dict):
        raise SecAggError("the share ciphertexts must be a map of device id to bytes")
    return {peer: _plain(value) for peer, value in ciphertexts.items()}


def check_secure_run(config: RunConfig, algorithm: type[ServerAlgorithm]) -> None:
    """Refuse, before anything starts, a `--secure-aggregation` run that needs to see single
    updates or whose aggregation is not a sum, naming the setting (ConfigError)."""
    if not config.secagg.secure_aggregation:
        return
    refusals = [
        (algorithm.unshardable is not None, "algorithm",
         f"{algorithm.id}: {algorithm.unshardable}, and secure aggregation gives the coordinator only a sum"),
        (config.aggregation.rule != "mean", "aggregation",
         f"{config.aggregation.rule} needs every single update, which secure aggregation hides: use mean"),
        (config.aggregation.clip_norm > 0, "clip_norm",
         "the coordinator cannot clip an update it cannot see: the devices clip to secagg_clip instead"),
        (config.round.max_update_norm > 0, "max_update_norm",
         "the coordinator cannot check the norm of an update it cannot see: the devices clip to secagg_clip instead"),
        (config.privacy.enabled and config.privacy.dp != "distributed", "dp",
         f"{config.privacy.dp}: under secure aggregation the devices add the noise in shares before masking: use "
         "dp distributed"),
        (config.training.upload_codec != "fp32", "upload_codec",
         "the masked vector is the upload (fixed point in 32 bits): use fp32"),
        (config.round.late_updates != "discard", "late_updates",
         "a late masked update cannot be unmasked after its round: use discard"),
    ]
    for refused, key, why in refusals:
        if refused:
            raise ConfigError(f"secure_aggregation: {key} {why}")
