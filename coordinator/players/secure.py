"""Secure rounds: synchronous rounds under secure aggregation, and the SECAGG stages they play.

A secure round (coordinator/rounds/secagg.py holds its state): the selected devices advertise
keys and share secrets within their group (the round's devices, or each shard's), those that did
train and upload masked vectors (to the coordinator, or to their shard's aggregator, which sums
them still masked), the survivors of each group unmask its sum, and the algorithm folds each
sum in as a partial sum. `SecureStages` plays the stages (advertise, share, the shares'
delivery, confirm, unmask) for a round and for a release pool summed securely. Loaded with a
secure run only (cryptography comes with it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from edge_sdk.channel import Received
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, ProtocolError, aggregator_id
from edge_sdk.secagg import stages
from edge_sdk.secagg.errors import SecAggError

from ..events import RoundAggregated
from ..privacy.none import NoPrivacy
from ..rounds.collector import Outcome, RoundCollector
from ..rounds.secagg import MIN_PARTICIPANTS, DeviceRefusal, SecureGroups, SecureRound
from ..shards.sharding import AGGREGATOR, shard_of
from .context import RunContext
from .exchange import Exchange
from .sync import SynchronousRounds, Training

log = logging.getLogger(__name__)


class SecureStages:
    """The SECAGG stages of one secure sum's groups, over the run's `Exchange`."""

    def __init__(self, run: RunContext, exchange: Exchange):
        self.run, self.exchange = run, exchange

    def share_keys(self, secure: SecureGroups) -> None:
        """The advertise and share stages; a group in which fewer than MIN_PARTICIPANTS devices
        shared their keys is dropped (its sum would tell each device the others')."""
        if secure.rounds:
            self.stage(secure, stages.ADVERTISE, sorted(secure.group_of))
            advertised = sorted(d for r in secure.rounds.values() for d in r.server.advertised)
            self.stage(secure, stages.SHARE, advertised)
        for group, part in sorted(secure.rounds.items()):
            if len(part.server.shared) < MIN_PARTICIPANTS:
                secure.drop(group, f"only {len(part.server.shared)} devices shared their keys; at least "
                                   f"{MIN_PARTICIPANTS} needed")

    def deliver_shares(self, secure: SecureGroups) -> None:
        """The `shares` delivery: each device that shared keys gets the ciphertexts addressed to it."""
        run = self.run
        for device, delivery in secure.deliveries().items():
            run.outbox.send(run.topics.down(device, Kind.SECAGG),
                            Envelope(Kind.SECAGG, COORDINATOR, run_id=run.run_id, round=secure.round,
                                     config={stages.STAGE: stages.SHARES, "selected": [device], **delivery}))

    def unmask(self, secure: SecureGroups, lose: Callable[[str], object]) -> bool:
        """The confirm stage for the devices whose masked vector arrived (or was summed by their
        shard's aggregator), then the unmask stage for those that signed the survivor set; each
        group whose sum cannot be unmasked is dropped, its survivors passed to `lose`. False when
        no group is left."""
        survivors = sorted(d for r in secure.rounds.values() for d in r.server.survivors)
        if survivors:
            self.stage(secure, stages.CONFIRM, survivors)
            signers = sorted(d for r in secure.rounds.values() for d in r.server.signers)
            if signers:
                self.stage(secure, stages.UNMASK, signers)
        for group, part in sorted(secure.rounds.items()):
            try:
                part.server.result()
            except SecAggError as exc:
                log.warning("round %d: the secure sum%s could not be unmasked (%s)", secure.round,
                            f" of shard {group}" if secure.sharded else "", exc)
                for device in part.server.survivors:
                    lose(device)
                secure.drop(group, str(exc))
        return bool(secure.rounds)

    def stage(self, secure: SecureGroups, stage: str, devices: Iterable[str]) -> None:
        """Broadcast one SECAGG stage to `devices` and take their SECAGG_RES (each group's
        `SecureRound` keeps those it took) until each answered, went offline or the round's
        timeout passed. A device refusing the stage as inconsistent is counted under its reason."""
        run, exchange = self.run, self.exchange
        expected = sorted(devices)
        round_ = secure.round
        request = Envelope(Kind.SECAGG, COORDINATOR, run_id=run.run_id, round=round_,
                           config={stages.STAGE: stage, "selected": expected, **secure.config(stage)})
        collector = exchange.collector_for(round_, expected, quorum=len(expected))

        def on_reply(received: Received) -> None:
            envelope = received.envelope
            if exchange.admit(received, Kind.SECAGG_RES, round_, collector):
                try:
                    secure.on_reply(stage, envelope.sender, envelope.config)
                except DeviceRefusal as refusal:  # the device said why: counted, not NACKed
                    run.channel.reject(refusal.reason, f"SECAGG_RES refusing {refusal.detail}")
                    collector.refuse(envelope.sender, envelope.msg_id)
                    exchange.refusals[envelope.sender] = refusal.reason.value
                    return
                except ProtocolError as err:
                    exchange.refuse(envelope, collector, err.reason, err.detail)
                    return
                collector.accept(envelope.sender, envelope.msg_id, run.clock())

        exchange.request(Kind.SECAGG, request, collector, on_reply)


class SecureRounds(SynchronousRounds):
    """Synchronous rounds whose TRAIN is wrapped in the SECAGG stages (a `RoundPlayer`)."""

    def __init__(self, run: RunContext, exchange: Exchange):
        super().__init__(run, exchange)
        self.stages = SecureStages(run, exchange)

    def train(self, round_: int, selected: list[str], started: float, eligible: int) -> Training:
        """A round under secure aggregation; the Training says how far each stage got."""
        run, exchange = self.run, self.exchange
        run.algorithm.begin_round(round_)
        secure = self._groups(round_, selected, eligible)
        self.stages.share_keys(secure)
        shared = sorted(d for r in secure.rounds.values() for d in r.server.shared)
        log.info("round %d: %d of %d devices shared their keys; training", round_, len(shared), len(selected))
        if not secure.rounds:
            log.warning("round %d not trained: %s", round_, "; ".join(secure.failed))
            return Training(exchange.collector_for(round_, selected, quorum=len(selected)), Outcome.DEADLINE, False,
                            secure=secure.record())
        self.stages.deliver_shares(secure)
        task = Envelope(Kind.TRAIN, COORDINATOR, run_id=run.run_id, round=round_,
                        groups=run.algorithm.task_groups(round_),
                        config={"selected": shared, stages.SECURE: True, **run.task_config(round_, eligible)})
        # fewer masked vectors than MIN_PARTICIPANTS and their sum would tell each survivor the others'
        collector = exchange.collector_for(round_, shared, quorum=max(run.config.round.min_clients, MIN_PARTICIPANTS))

        def on_update(received: Received) -> None:
            envelope = received.envelope
            if exchange.admit(received, Kind.TRAIN_RES, round_, collector):
                try:
                    secure.rounds[0].on_masked(envelope.sender, envelope.groups)
                except ProtocolError as err:
                    exchange.refuse(envelope, collector, err.reason, err.detail)
                    return
                run.replied_after(run.clock() - started)
                collector.accept(envelope.sender, envelope.msg_id, run.clock())

        if secure.sharded:  # the masked vectors go to the shards' aggregators: their masked sums come here
            sharded = run.sharding.open(round_, shared, task, collector, secure=secure.rounds)
            try:
                outcome = exchange.request(Kind.TRAIN, task, collector, self.misrouted_update)
                run.sharding.gather(sharded, run.windows()[1], run.serve_stale)
            finally:
                run.sharding.close()
            for shard, why in sorted(sharded.lost.items()):
                secure.drop(shard, why)
        else:
            outcome = exchange.request(Kind.TRAIN, task, collector, on_update)
        aggregated = collector.enough and self._unmask_and_fold(secure, collector)
        return Training(collector, outcome, aggregated, secure=secure.record())

    def _groups(self, round_: int, selected: list[str], eligible: int) -> SecureGroups:
        """The round's secure groups: one of every selected device, or, sharded, one per shard whose
        aggregator is online (the devices of a shard without one sit the round out)."""
        run, privacy = self.run, self.run.privacy
        private = None
        if not isinstance(privacy, NoPrivacy):  # distributed DP: the fixed-denominator mean of clipped, noised changes
            private = (privacy.share_bound(eligible), privacy.expected(eligible))
        shards = run.sharding.shards
        members: dict[int, list[str]] = {}
        for device in selected:
            members.setdefault(shard_of(device, shards) if shards else 0, []).append(device)
        online = set(run.registry.online(AGGREGATOR)) if shards else set()
        examples = {device: run.registry.devices[device].num_examples for device in selected}
        rounds, failed = {}, []
        for group, devices in sorted(members.items()):
            if shards and aggregator_id(group) not in online:
                failed.append((group, "its aggregator is offline"))
                continue
            try:
                rounds[group] = SecureRound(run.config.secagg, run.run_id, round_, devices,
                                            run.algorithm.update_spec(round_), {d: examples[d] for d in devices},
                                            private=private, largest=max(examples.values()))
            except SecAggError as exc:  # too few devices online for a sum that hides each of them
                failed.append((group, str(exc)))
        secure = SecureGroups(round_, rounds, len(selected), sharded=shards > 0)
        for group, why in failed:
            secure.drop(group, why)
            log.warning("round %d: %s", round_, secure.failed[-1])
        return secure

    def _unmask_and_fold(self, secure: SecureGroups, collector: RoundCollector) -> bool:
        """The unmask stage, then each group's sum folded in as a partial sum and the round's
        state made; False (nothing aggregated) when no group can be unmasked. The devices of a
        group that cannot be unmasked count as missing."""
        run = self.run
        round_ = secure.round
        if not self.stages.unmask(secure, collector.lose):
            log.warning("round %d: nothing aggregated, global state unchanged", round_)
            return False
        summed = sum(len(part.server.survivors) for part in secure.rounds.values())
        run.privacy.note_secure_sum(summed)
        aggregating = run.clock()
        for part in secure.rounds.values():  # under distributed DP the shares of the denominator add up to 1
            run.algorithm.fold_partial(round_, part.partial(share=len(part.server.survivors) / summed))
        run.algorithm.close_round(round_)
        run.events.emit(RoundAggregated(round_, summed, run.clock() - aggregating))
        return True
