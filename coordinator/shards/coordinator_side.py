"""The coordinator's side of sharded aggregation (`shards` K > 0), one training round at a time.

Before a round's TRAIN the coordinator sends each shard with selected trainers a ROSTER (a shard
whose aggregator is offline is lost from the start). While the round is open, each aggregator's
NOTEs say which updates it folded (they count as replies that arrived) and which it refused
(rejected replies: the device is not waited for any more and, when the NOTE names the refused
update's msg_id, gets the NACK a refused reply gets); when the round closes, CLOSE asks the
shards still open for their PARTIAL, which is checked and folded into the algorithm's sums. A
shard whose aggregator goes offline, whose PARTIAL is refused, or that sends none before the
timeout is lost for the round: its updates are not aggregated, and its devices count as
missing. An aggregator that registers again while its shard's PARTIAL is still expected (after
a reconnection, or on finding that it missed the round's ROSTER or TRAIN) gets both again on its
own topics, and each device of its shard not yet heard from gets the TRAIN again on its own: a
device that answered sends its kept reply again. The pure bookkeeping is `sharding.ShardRound`;
this module reads and answers the aggregators.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from edge_sdk.protocol import COORDINATOR, Envelope, Kind, ProtocolError, Reason, aggregator_id, shard_of_aggregator
from edge_sdk.secagg import stages

from ..fleet.outbox import Outbox, resent
from ..aggregation.validation import UpdateLimits
from ..algorithms.base import ServerAlgorithm
from ..fleet.devices import DeviceRegistry
from ..rounds.collector import RoundCollector
from ..run.ledger import Ledger
from .sharding import AGGREGATOR, ShardRound, check_masked_partial, check_partial, shard_of

if TYPE_CHECKING:
    from ..rounds.secagg import SecureRound

log = logging.getLogger(__name__)


class ShardedRounds:
    """ROSTERs out, NOTEs and PARTIALs in, for the training round open now (`current`)."""

    def __init__(self, shards: int, algorithm: ServerAlgorithm, limits: UpdateLimits, registry: DeviceRegistry,
                 outbox: Outbox, ledger: Ledger, clock: Callable[[], float]):
        self.shards = shards
        self.algorithm = algorithm
        self.limits = limits
        self.registry = registry
        self.outbox = outbox
        self.ledger = ledger
        self.clock = clock
        self.current: ShardRound | None = None
        """The training round's shards, while it is open."""
        self._task: Envelope | None = None
        """The open round's TRAIN, and each shard's ROSTER: what an aggregator that registers again gets again."""
        self._rosters: dict[int, Envelope] = {}
        self._closing = False
        self.secure: Mapping[int, SecureRound] = {}
        """Under secure aggregation, each shard's secure round: its PARTIAL is a masked sum."""

    def open(self, round_: int, selected: list[str], task: Envelope, collector: RoundCollector,
             secure: Mapping[int, SecureRound] | None = None) -> ShardRound:
        """Send each shard's aggregator its ROSTER (before the TRAIN broadcast `task`); a
        shard whose aggregator is offline is lost from the start. The round is `current` until
        `close`. Under secure aggregation (`secure`: each shard's round) the ROSTER says the
        length of the masked vectors, and the shard's PARTIAL is their sum, still masked."""
        rosters: dict[int, dict[str, int]] = {}
        for client_id in selected:
            rosters.setdefault(shard_of(client_id, self.shards), {})[client_id] = \
                self.registry.devices[client_id].num_examples
        sharded = ShardRound(task.msg_id, rosters, collector)
        online = set(self.registry.online(AGGREGATOR))
        run_id = self.outbox.position.run_id
        for shard, roster in sorted(rosters.items()):
            if aggregator_id(shard) not in online:
                self.lose(shard, "its aggregator is offline", sharded)
                continue
            config: dict[str, Any] = {"request": task.msg_id, "devices": roster}
            if secure is not None:
                config[stages.SECURE] = {stages.LENGTH: secure[shard].context.vector_length}
            self._rosters[shard] = Envelope(Kind.ROSTER, COORDINATOR, run_id=run_id, round=round_, config=config)
            self.outbox.send(self.outbox.topics.down(aggregator_id(shard), Kind.ROSTER), self._rosters[shard])
        self.current, self.secure, self._task, self._closing = sharded, secure or {}, task, False
        return sharded

    def close(self) -> None:
        self.current, self.secure, self._task, self._rosters, self._closing = None, {}, None, {}, False

    def rejoined(self, client_id: str) -> None:
        """`client_id` registered again: if it is the aggregator of a shard whose PARTIAL the open
        round still expects, it may have missed the ROSTER, the TRAIN or its devices' updates.
        It gets the ROSTER and the TRAIN again (same msg_ids: a copy it has is dropped), and the
        CLOSE if the round closed; while the round collects, each device of its shard not yet
        heard from gets the TRAIN again on its own topic."""
        shard, sharded, task = shard_of_aggregator(client_id), self.current, self._task
        if shard is None or sharded is None or task is None or shard not in sharded.open_shards:
            return
        topics = self.outbox.topics
        self.outbox.send(topics.down(client_id, Kind.ROSTER), resent(self._rosters[shard]))
        self.outbox.send(topics.down(client_id, Kind.TRAIN), resent(task))
        if self._closing:
            self.outbox.send(topics.down(client_id, Kind.CLOSE), self._close_for(sharded))
            owed: list[str] = []
        else:
            owed = sorted(set(sharded.rosters[shard]) & sharded.collector.waiting)
            for device in owed:
                self.outbox.send(topics.down(device, Kind.TRAIN), resent(task))
        log.warning("round %d: aggregator of shard %d registered again; its ROSTER and the TRAIN sent again, and the "
                    "TRAIN to %d of its devices not yet heard from", sharded.collector.round, shard, len(owed))

    def on_message(self, envelope: Envelope) -> None:
        """A NOTE or PARTIAL: from a registered aggregator of this run, for the open training round."""
        if envelope.run_id != self.outbox.position.run_id:
            self.outbox.reject(envelope, Reason.WRONG_RUN, f"{envelope.kind.value} from {envelope.sender}: run "
                                                           f"{envelope.run_id!r}")
        elif self.registry.kind_of(envelope.sender) != AGGREGATOR:
            self.outbox.reject(envelope, Reason.UNKNOWN_DEVICE, f"{envelope.kind.value} from {envelope.sender}, not "
                                                                "a registered shard aggregator")
        elif self.current is None:
            self.outbox.reject(envelope, Reason.STALE, f"{envelope.kind.value} from {envelope.sender} for round "
                                                       f"{envelope.round}")
        else:
            self._for_open_round(self.current, envelope)

    def _for_open_round(self, sharded: ShardRound, envelope: Envelope) -> None:
        shard = shard_of_aggregator(envelope.sender)
        expected = envelope.config.get("in_reply_to") == sharded.request_id
        if shard is None or not expected or shard not in sharded.open_shards:
            self.outbox.reject(envelope, Reason.STALE, f"{envelope.kind.value} from {envelope.sender} for round "
                                                       f"{envelope.round} is not expected (closed, lost or another "
                                                       "round)")
        elif envelope.kind is Kind.NOTE:
            self._on_note(sharded, shard, envelope)
        else:
            self._on_partial(sharded, shard, envelope)

    def _on_note(self, sharded: ShardRound, shard: int, note: Envelope) -> None:
        """Updates shard `shard`'s aggregator folded or refused: the round's progress."""
        roster, now = sharded.rosters[shard], self.clock()
        accepted, refused = note.config.get("accepted", []), note.config.get("refused", [])
        if not isinstance(accepted, list) or not isinstance(refused, list):
            self.outbox.reject(note, Reason.MALFORMED, f"NOTE from {note.sender}: accepted and refused must be lists")
            return
        for client_id in accepted:
            if client_id not in roster:
                self.outbox.reject(note, Reason.NOT_SELECTED, f"NOTE from {note.sender}: {client_id!r} is not "
                                                              f"selected in shard {shard}")
            else:
                sharded.folded(shard, client_id, note.msg_id, now)
        for entry in refused:
            refusal = _refusal(entry)
            if refusal is None:
                self.outbox.reject(note, Reason.MALFORMED, f"NOTE from {note.sender}: a refused entry is not "
                                                           "[client id, reason, detail] or [..., msg_id]")
                continue
            client_id, reason, detail, msg_id = refusal
            if client_id not in roster or client_id in sharded.collector.replied:
                self.outbox.reject(note, Reason.NOT_SELECTED, f"NOTE from {note.sender}: refusal of {client_id!r}")
                continue
            if msg_id is not None and sharded.collector.check(client_id, msg_id) is Reason.DUPLICATE:
                self.outbox.channel.count_duplicate()
                continue
            self._refused(client_id, msg_id, note, reason, f"update from {client_id} (shard {shard}): {detail}")
            sharded.collector.refuse(client_id, msg_id or f"{note.msg_id}/{client_id}")

    def _refused(self, client_id: str, msg_id: str | None, note: Envelope, reason: str, detail: str) -> None:
        """Count the refusal of `client_id`'s update that `note` reports; when the note names the
        update (`msg_id`), the device learns why by the NACK any refused reply gets (`Outbox.reject`:
        rate-limited, registered devices only). An aggregator that names none is older: counted only."""
        code = Reason(reason) if reason in Reason._value2member_map_ else Reason.MALFORMED
        if msg_id is None:
            self.outbox.channel.reject(code, detail)
            return
        self.outbox.refuse(client_id, Kind.TRAIN_RES, msg_id, code, detail)

    def _on_partial(self, sharded: ShardRound, shard: int, partial: Envelope) -> None:
        """Check shard `shard`'s PARTIAL and fold it in; a refused one loses the shard's round."""
        round_ = sharded.collector.round
        try:
            if shard in self.secure:  # unmasked with the shard's other survivors once every partial is in
                masked = check_masked_partial(partial, shard, sharded.rosters[shard],
                                              self.secure[shard].context.vector_length)
                if masked.folded:
                    self.secure[shard].on_masked_sum(shard, masked.folded, masked.total)
                sharded.deliver(masked.shard, masked.folded, partial.msg_id, self.clock())
                log.info("round %d: masked partial of shard %d taken (%d updates)", round_, shard, len(masked.folded))
                return
            checked = check_partial(partial, shard, sharded.rosters[shard], self.algorithm.partial_spec(round_),
                                    self.limits.max_examples)
        except ProtocolError as err:
            self.outbox.reject(partial, err.reason, f"PARTIAL from {partial.sender}: {err.detail}")
            self.lose(shard, f"its partial was refused ({err.reason.value})", sharded)
            return
        if checked.folded:
            self.algorithm.fold_partial(round_, checked.sums)
        sharded.deliver(checked.shard, checked.folded, partial.msg_id, self.clock())
        log.info("round %d: partial of shard %d folded (%d updates)", round_, shard, len(checked.folded))

    def aggregator_offline(self, client_id: str) -> None:
        """A device went offline: if it is the aggregator of a shard of the open round, that shard is lost."""
        shard = shard_of_aggregator(client_id)
        if self.current is not None and shard is not None:
            self.lose(shard, "its aggregator went offline", self.current)

    def lose(self, shard: int, why: str, sharded: ShardRound) -> None:
        """Shard `shard` delivers nothing this round (if it was still expected to), logged and recorded."""
        if shard in sharded.open_shards:
            lost = sharded.lose(shard, why)
            log.warning("round %d: shard %d lost, %s: %d folded updates not aggregated", sharded.collector.round,
                        shard, why, lost)
            self.ledger.event("shard_lost", shard=shard, round=sharded.collector.round, updates=lost, why=why)

    def gather(self, sharded: ShardRound, timeout: float, serve: Callable[[float], None]) -> None:
        """The round closed: ask the aggregators still summing for their PARTIAL and wait for
        them (handling messages with `serve(timeout)`, up to `timeout` seconds); a shard that
        does not deliver is lost."""
        self._closing = True
        for shard in sharded.open_shards:
            self.outbox.send(self.outbox.topics.down(aggregator_id(shard), Kind.CLOSE), self._close_for(sharded))
        deadline = self.clock() + timeout
        while sharded.open_shards and self.clock() < deadline:
            serve(min(1.0, deadline - self.clock()))
        for shard in sharded.open_shards:
            self.lose(shard, "no partial came before the timeout", sharded)

    def _close_for(self, sharded: ShardRound) -> Envelope:
        """The CLOSE that asks an aggregator for the round's PARTIAL now."""
        return Envelope(Kind.CLOSE, COORDINATOR, run_id=self.outbox.position.run_id, round=sharded.collector.round,
                        config={"request": sharded.request_id})


def _refusal(entry: object) -> tuple[str, str, str, str | None] | None:
    """A NOTE's `refused` entry as (client id, reason code, detail, msg_id or None): a list of 3
    strings, or 4 with the refused update's msg_id; None for anything else."""
    if not isinstance(entry, list) or len(entry) not in (3, 4) or not all(isinstance(part, str) for part in entry):
        return None
    client_id, reason, detail = entry[:3]
    return client_id, reason, detail, entry[3] if len(entry) == 4 else None
