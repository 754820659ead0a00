"""Sharded aggregation, the coordinator's side: which shard a device is in, what may be sharded,
the checks on a shard's PARTIAL, and one round's bookkeeping of its shards.

With `shards` K > 0, each trainer belongs to shard `shard_of(id, K)` (a stable hash of its id:
the same shard in every run and after any restart, whatever the registration order, so a
shard's sum repeats and a lost shard's devices are known). Shard k's aggregator
(`edgepfl aggregator --shard k/K`, `coordinator.shards.aggregator`) reads its devices' updates, checks
them as the coordinator would, sums their weighted changes and sends one PARTIAL per round;
NOTEs on the way say which updates it folded or refused, so the coordinator's `RoundCollector`
applies quorum, grace and deadline as it does unsharded. The coordinator adds the partials up
(`ServerAlgorithm.fold_partial`): reference + sum of sums / sum of weights is the mean of every
update (`WeightedMean`), the same figure as unsharded (in float64 mode, to the last bit in
practice: the summands are exact in float64).

Under secure aggregation a shard's PARTIAL is the sum of its devices' masked vectors, still
masked (`check_masked_partial`); the coordinator unmasks it (coordinator/rounds/secagg.py).

A shard whose aggregator goes offline, or whose PARTIAL is refused or does not come, is lost
for the round: its updates are not aggregated and the round record names it (`lost_shards`,
`lost_updates`); the other shards aggregate if the quorum allows.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_sdk.config import ConfigError
from edge_sdk.params import ArraySpec, check_arrays
from edge_sdk.protocol import ArrayGroup, Envelope, Reason, ValidationError
from edge_sdk.secagg.stages import MASKED, SECURE

from ..aggregation.averaging import PartialSum
from ..rounds.collector import RoundCollector

if TYPE_CHECKING:
    from ..algorithms.base import ServerAlgorithm

AGGREGATOR = "aggregator"
"""The device type a shard aggregator registers with (HELLO `device_type`)."""


def shard_of(client_id: str, shards: int) -> int:
    """The shard of device `client_id` among `shards`: a stable hash of the id (sha256)."""
    return int.from_bytes(hashlib.sha256(client_id.encode()).digest()[:8], "big") % shards


def check_shardable(algorithm: type[ServerAlgorithm], aggregation_rule: str, shards: int) -> None:
    """Refuse, naming why, a run whose aggregation cannot be split over `shards` aggregators."""
    if not shards:
        return
    if algorithm.unshardable is not None:
        raise ConfigError(f"shards {shards}: algorithm {algorithm.id} cannot be aggregated in shards: "
                          f"{algorithm.unshardable}; use shards 0")
    if aggregation_rule != "mean":
        raise ConfigError(f"shards {shards}: aggregation {aggregation_rule} needs every update of the round in one "
                          "place (a median or trimmed mean of shard results is another rule, not offered); use "
                          "aggregation mean (clip_norm clips each update exactly, sharded or not) or shards 0")


@dataclass
class ShardPartial:
    """A checked PARTIAL: the devices its shard folded, in order, and the sums by group."""

    shard: int
    folded: list[str]
    sums: dict[str, PartialSum]


def check_partial(envelope: Envelope, shard: int, roster: Mapping[str, int], spec: dict[str, ArraySpec],
                  max_examples: int) -> ShardPartial:
    """Raise ValidationError for a PARTIAL of shard `shard` that must be refused: devices not of
    its `roster` (selected device -> registered examples) or repeated, a count that is not theirs,
    groups, names, shapes or dtypes other than `spec`, non-finite values, a total weight that is
    not positive or exceeds its devices' registered examples (capped at `max_examples`)."""
    folded = _checked_folded(envelope, shard, roster)
    weight = envelope.metrics.get("total_weight")
    if not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValidationError(Reason.MALFORMED, f"total_weight {weight!r}")
    if not folded:
        if envelope.groups or weight != 0:
            raise ValidationError(Reason.UNEXPECTED_ARRAYS, "an empty partial carries no arrays and no weight")
        return ShardPartial(shard, [], {})
    if set(envelope.groups) != set(spec):
        raise ValidationError(Reason.UNEXPECTED_ARRAYS, f"groups {sorted(envelope.groups)}, want {sorted(spec)}")
    for group, expected in spec.items():
        check_arrays(group, envelope.groups[group], expected)
    ceiling = sum(min(roster[c], max_examples) for c in folded)
    if not 0 < weight <= ceiling:
        raise ValidationError(Reason.MALFORMED, f"total_weight {weight} not in (0, {ceiling}], the registered "
                                                "examples of its devices")
    return ShardPartial(shard, list(folded), {g: PartialSum(envelope.groups[g], float(weight), len(folded))
                                              for g in spec})


def _checked_folded(envelope: Envelope, shard: int, roster: Mapping[str, int]) -> list[str]:
    """The devices a PARTIAL of shard `shard` folded: distinct, of its `roster`, as many as its count."""
    if envelope.config.get("shard") != shard:
        raise ValidationError(Reason.SENDER_MISMATCH, f"partial of shard {envelope.config.get('shard')!r} from "
                                                      f"shard {shard}'s aggregator")
    folded = envelope.config.get("folded")
    if not isinstance(folded, list) or not all(isinstance(c, str) for c in folded) or len(set(folded)) != len(folded):
        raise ValidationError(Reason.MALFORMED, "folded must be a list of distinct device ids")
    strangers = [c for c in folded if c not in roster]
    if strangers:
        raise ValidationError(Reason.NOT_SELECTED, f"folded devices not selected in shard {shard}: {strangers[:5]}")
    if envelope.metrics.get("count") != len(folded):
        raise ValidationError(Reason.MALFORMED, f"count {envelope.metrics.get('count')!r} for {len(folded)} folded "
                                                "devices")
    return list(folded)


@dataclass
class MaskedPartial:
    """A checked PARTIAL of a round under secure aggregation: the devices its shard folded and
    the sum of their masked vectors (uint32, still masked)."""

    shard: int
    folded: list[str]
    total: np.ndarray


def check_masked_partial(envelope: Envelope, shard: int, roster: Mapping[str, int], length: int) -> MaskedPartial:
    """Raise ValidationError for a masked PARTIAL of shard `shard` that must be refused: devices
    not of its `roster` or repeated, a count that is not theirs, anything but one int32 vector of
    the round's `length` in `secagg/masked` (none when nothing was folded)."""
    folded = _checked_folded(envelope, shard, roster)
    if not folded:
        if envelope.groups:
            raise ValidationError(Reason.UNEXPECTED_ARRAYS, "an empty partial carries no arrays")
        return MaskedPartial(shard, [], np.zeros(length, dtype=np.uint32))
    masked = envelope.groups.get(SECURE, {}).get(MASKED) if set(envelope.groups) == {SECURE} else None
    if masked is None or set(envelope.groups[SECURE]) != {MASKED} or masked.dtype != np.int32 or \
            masked.shape != (length,):
        raise ValidationError(Reason.UNEXPECTED_ARRAYS, f"a masked partial carries only {SECURE}/{MASKED}, int32 of "
                                                        f"length {length}")
    return MaskedPartial(shard, folded, np.ascontiguousarray(masked).view(np.uint32))


def masked_partial_fields(total: np.ndarray, folded: list[str]) -> dict[str, Any]:
    """What a masked PARTIAL carries (groups, metrics, config but `in_reply_to` and `shard`): the
    sum of the `folded` devices' masked vectors, none when nothing was folded."""
    groups: dict[str, ArrayGroup] = {SECURE: {MASKED: total.view(np.int32)}} if folded else {}
    return {"groups": groups, "metrics": {"total_weight": 0.0, "count": len(folded)},
            "config": {"folded": list(folded)}}


def partial_envelope_fields(sums: dict[str, PartialSum], folded: list[str]) -> dict[str, Any]:
    """What a PARTIAL carries (groups, metrics, config but `in_reply_to` and `shard`) for `sums`
    over the `folded` devices: an empty partial carries no arrays."""
    weight = next(iter(sums.values())).total_weight if folded and sums else 0.0
    groups: dict[str, ArrayGroup] = {g: p.sums for g, p in sums.items()} if folded else {}
    return {"groups": groups, "metrics": {"total_weight": weight, "count": len(folded)},
            "config": {"folded": list(folded)}}


@dataclass
class ShardRound:
    """One training round's shards at the coordinator: who each shard's selected devices are
    (`rosters`), which updates their aggregators reported folded (`noted`), which PARTIALs came
    (`delivered`) and which shards are lost, and why. It keeps the round's `collector` in step:
    a device whose update was folded counts as replied, one whose shard is lost as missing."""

    request_id: str
    rosters: dict[int, dict[str, int]]
    collector: RoundCollector
    noted: dict[int, set[str]] = field(default_factory=dict)
    delivered: dict[int, list[str]] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    lost_updates: int = 0

    def shard_with(self, client_id: str) -> int | None:
        return next((k for k, roster in self.rosters.items() if client_id in roster), None)

    @property
    def open_shards(self) -> list[int]:
        """Shards still expected to send their PARTIAL."""
        return sorted(k for k in self.rosters if k not in self.delivered and k not in self.lost)

    def folded(self, shard: int, client_id: str, msg_id: str, now: float) -> None:
        """Shard `shard`'s aggregator folded `client_id`'s update."""
        self.noted.setdefault(shard, set()).add(client_id)
        if client_id not in self.collector.replied:
            self.collector.accept(client_id, msg_id, now)

    def deliver(self, shard: int, folded: list[str], msg_id: str, now: float) -> None:
        """Shard `shard`'s checked PARTIAL over `folded` was taken: its devices count as replied
        (also those folded after the round closed, before the aggregator heard it)."""
        self.delivered[shard] = folded
        for client_id in folded:
            self.folded(shard, client_id, msg_id, now)

    def lose(self, shard: int, why: str) -> int:
        """Shard `shard` delivers nothing this round: the updates its aggregator reported folded
        are lost and its devices count as missing; returns how many updates were lost."""
        if shard not in self.open_shards:
            return 0
        self.lost[shard] = why
        lost = 0
        for client_id in self.rosters[shard]:
            lost += self.collector.lose(client_id)
        self.lost_updates += lost
        return lost
