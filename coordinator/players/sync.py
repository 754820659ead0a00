"""`SynchronousRounds`: a run's rounds, one after another.

One round: wait for a quorum of online trainers -> select devices (seeded; sampled secretly
under DP) -> broadcast TRAIN once -> collect validated replies until all / quorum+grace /
deadline (both grow with the reply times measured, `rounds.collector.round_windows`) -> aggregate (with
the previous round's late updates under `late_updates = "next_round"`). With `shards` K > 0 the
updates go to the shard aggregators and their partial sums come here (`shards.coordinator_side`); an update
sent here instead is refused (`bad_topic`). A late update of the round before is dropped, or
checked and kept for the next round (`LateUpdates`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edge_sdk.channel import Received
from edge_sdk.codecs import UploadCodec
from edge_sdk.downlink import DOWNLINK
from edge_sdk.protocol import COORDINATOR, ArrayGroup, Envelope, Kind, ProtocolError, Reason

from ..aggregation.validation import checked_update
from ..events import RoundAggregated, RoundDevices, RoundStarted, UpdateAccepted
from ..rounds.collector import Outcome, RoundCollector
from ..shards.sharding import shard_of
from .base import TrainedRound
from .context import RunContext
from .exchange import Exchange

if TYPE_CHECKING:
    from ..rounds.secagg import SecureRoundRecord
    from ..shards.sharding import ShardRound

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Training:
    """How a round's TRAIN went: its collector and outcome, whether it aggregated, how many
    late updates it folded, and its shards' or secure groups' record."""

    collector: RoundCollector
    outcome: Outcome
    aggregated: bool
    folded: int = 0
    sharded: ShardRound | None = None
    secure: SecureRoundRecord | None = None


class SynchronousRounds:
    """Plays synchronous rounds over the run's `Exchange` (a `RoundPlayer`)."""

    label = "round"

    def __init__(self, run: RunContext, exchange: Exchange):
        self.run, self.exchange = run, exchange

    def play(self, round_: int, started: float) -> TrainedRound:
        """Select the round's devices, train them (securely if asked) and aggregate."""
        run, exchange = self.run, self.exchange
        candidates = self._await_trainers(max(1, run.config.round.min_clients))
        run.privacy.check_budget(len(candidates))
        selected = run.privacy.select(candidates, round_)
        if not run.privacy.distributed:  # distributed: the secure sum over the fixed denominator
            run.algorithm.private_mean = run.privacy.aggregator(len(candidates), round_)
        run.events.emit(RoundStarted(round_, tuple(selected)))
        run.status("training")
        training = self.train(round_, selected, started, len(candidates))
        collector = training.collector
        run.privacy.round_ended(len(candidates), selected, round_)
        exchange.stop_if_every_device_refused("train", round_, selected, collector.replied)
        devices = RoundDevices(replied=tuple(sorted(collector.replied)),
                               refused={d: exchange.refusals.get(d, "refused") for d in sorted(collector.refused)},
                               late=tuple(sorted(collector.waiting)), missing=tuple(sorted(collector.offline)),
                               accuracy={})
        aggregated = training.aggregated
        return TrainedRound(len(selected), len(collector.replied) if aggregated else 0,
                            training.outcome.value if aggregated else "aborted", len(collector.replied), devices,
                            folded=training.folded, sharded=training.sharded, secure=training.secure)

    def on_hello(self, client_id: str) -> None:
        """Nothing waits for it but the open request (`Exchange.on_hello`)."""

    def on_offline(self, client_id: str) -> None:
        """Only the open request waits for devices (`Exchange.on_offline`)."""

    def takes(self, received: Received) -> bool:
        """A late update of the round before (`LateUpdates.expects`)."""
        envelope = received.envelope
        if not self.run.late.expects(envelope.sender, envelope.round, envelope.config.get("in_reply_to")):
            return False
        self._late_update(envelope)
        return True

    def _await_trainers(self, wanted: int) -> list[str]:
        """The online trainers a round may select, once `wanted` of them are online or the round
        timeout passed: in a fleet whose devices come and go, a round waits for a quorum to be
        there instead of closing at once with nobody selected."""
        run = self.run
        deadline = run.clock() + run.windows()[1]
        if len(run.trainers_online()) < wanted:
            log.info("waiting for %d online trainers (%d now) before the next round", wanted,
                     len(run.trainers_online()))
        while len(run.trainers_online()) < wanted and (left := deadline - run.clock()) > 0:
            run.serve_stale(min(1.0, left))
        return run.trainers_online()

    def train(self, round_: int, selected: list[str], started: float, eligible: int) -> Training:
        """Broadcast TRAIN, fold the replies in (and the previous round's late updates kept for
        this one), aggregate; the Training says how many late updates were folded and, sharded,
        the round's shards. What was broadcast is let go on return, before evaluation and the
        checkpoint (kept only while late updates may be folded against it). Under a lossy
        `downlink_codec` TRAIN carries the change from the held state, and updates are checked
        against the state devices reconstruct from it."""
        run = self.run
        run.algorithm.begin_round(round_)
        downlink = self.exchange.downlink  # what goes down, and what devices then hold and train from
        carried, groups, announced = downlink.prepare(round_, run.algorithm.task_groups(round_))
        config = {"selected": selected, **run.task_config(round_, eligible)}
        if announced is not None:
            config[DOWNLINK] = announced
        task = Envelope(Kind.TRAIN, COORDINATOR, run_id=run.run_id, round=round_, groups=carried, config=config)
        grace, timeout = run.windows()
        collector = RoundCollector(
            round_,
            frozenset(selected),
            min_replies=max(1, min(run.config.round.min_clients, len(selected))),
            deadline=run.clock() + timeout,
            grace=grace,
            rejoin=run.config.round.quorum_grace,
        )
        sharded: ShardRound | None = None
        on_update: Callable[[Received], None]
        if run.sharding.shards:
            sharded = run.sharding.open(round_, selected, task, collector)
            on_update = self.misrouted_update
        else:
            def on_update(received: Received) -> None:
                self._on_update(received, round_, groups, collector, started)
        try:
            outcome = self.exchange.request(Kind.TRAIN, task, collector, on_update, full=downlink.full(task))
            if sharded is not None:
                run.sharding.gather(sharded, run.windows()[1], run.serve_stale)
        finally:
            run.sharding.close()
        late = run.late.take(frozenset(collector.replied), aggregating=collector.enough)
        if collector.enough:
            aggregating = run.clock()
            for update in late:
                run.algorithm.accumulate(update.sender, update.groups, update.metrics, update.weight)
            run.algorithm.close_round(round_)
            run.events.emit(RoundAggregated(round_, len(collector.replied) + len(late), run.clock() - aggregating))
        else:
            log.warning("round %d: %d of %d replies, below the quorum of %d; nothing aggregated, global state "
                        "unchanged", round_, len(collector.replied), len(selected), collector.min_replies)
        run.late.close(round_, task.msg_id, groups, collector.waiting)
        return Training(collector, outcome, collector.enough, len(late), sharded)

    def misrouted_update(self, received: Received) -> None:
        """An update sent to the coordinator in a sharded run (it goes to the device's shard)."""
        envelope, exchange = received.envelope, self.exchange
        collector = exchange.collector
        if collector is not None and exchange.admit(received, Kind.TRAIN_RES, envelope.round, collector):
            exchange.refuse(envelope, collector, Reason.BAD_TOPIC,
                            f"update from {envelope.sender} sent to the coordinator; this run is sharded (shard "
                            f"{shard_of(envelope.sender, self.run.sharding.shards)})")

    def _on_update(self, received: Received, round_: int, sent: dict[str, ArrayGroup], collector: RoundCollector,
                   started: float) -> None:
        run = self.run
        envelope = received.envelope
        if envelope.kind is Kind.TRAIN_RES and envelope.round == round_:
            run.privacy.note_upload(envelope.sender, envelope.msg_id)  # refused or not, it went up
        if not self.exchange.admit(received, Kind.TRAIN_RES, round_, collector):
            return
        registered = run.registry.devices[envelope.sender].num_examples
        validating = run.clock()
        try:
            groups, weight = checked_update(run.algorithm, round_, envelope, sent, registered, run.limits,
                                            UploadCodec.of(run.config.training))
            run.privacy.note_update(envelope.metrics)
        except ProtocolError as err:
            self.exchange.refuse(envelope, collector, err.reason, f"update from {envelope.sender}: {err.detail}")
            return
        accumulating = run.clock()
        run.algorithm.accumulate(envelope.sender, groups, envelope.metrics, weight)
        accepted = run.clock()
        collector.accept(envelope.sender, envelope.msg_id, accepted)
        run.replied_after(accepted - started)
        run.events.emit(UpdateAccepted(round_, envelope.sender, received.size, accepted - started,
                                       accumulating - validating, accepted - accumulating))

    def _late_update(self, envelope: Envelope) -> None:
        """An update of the last closed round from a device it stopped waiting for: dropped
        (counted), or checked against what its round sent and kept for the next round."""
        run, late = self.run, self.run.late
        round_ = late.round
        if not late.folds:
            late.discard(envelope.sender)
            log.info("round %d: late update from %s discarded (late_updates = discard)", round_, envelope.sender)
            return
        registered = run.registry.devices[envelope.sender].num_examples
        try:
            groups, weight = checked_update(run.algorithm, round_, envelope, late.sent, registered, run.limits,
                                            UploadCodec.of(run.config.training))
        except ProtocolError as err:
            late.arrived(envelope.sender)
            run.outbox.reject(envelope, err.reason, f"late update from {envelope.sender}: {err.detail}")
            return
        late.keep(envelope.sender, groups, envelope.metrics, weight)
        log.info("round %d: late update from %s kept for round %d", round_, envelope.sender, round_ + 1)
