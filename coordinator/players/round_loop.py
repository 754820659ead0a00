"""`RoundLoop`: one round of a run, from its training to its line in metrics.jsonl.

The round player trains (or, asynchronously, aggregates a step); then the devices evaluate
when due (every `eval_every` rounds and the last), the round is checkpointed, and its record
(who took part: selected, aggregated, refused, late, missing; bytes; accuracy; DP; secure
stages; the step's staleness) goes to the ledger, metrics.jsonl, the log and `RoundEnded`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import asdict

from ..events import RoundEnded, RoundEvaluated
from ..run.records import RoundRecord
from ..run.report_files import summarize
from .base import RoundPlayer
from .context import RunContext
from .evaluation import Evaluation
from .exchange import Exchange
from .run_state import RunState

log = logging.getLogger(__name__)


class RoundLoop:
    """Plays a run's rounds one at a time with its `player`."""

    def __init__(self, run: RunContext, exchange: Exchange, player: RoundPlayer, evaluation: Evaluation,
                 state: RunState):
        self.run, self.exchange, self.player, self.evaluation, self.state = run, exchange, player, evaluation, state

    def play(self, round_: int) -> None:
        """Play round `round_`, evaluate it when due, checkpoint, and record it."""
        run = self.run
        started, (sent0, received0) = run.clock(), run.channel.counter.snapshot()
        channel0 = run.channel.counters.snapshot()
        delivered0, discarded0 = run.ledger.delivered_total(), run.late.discarded
        self.exchange.new_round()
        trained = self.player.play(round_, started)
        evaluation = None
        accuracy: dict[str, float] | None = None
        if round_ % run.config.round.eval_every == 0 or round_ == run.config.training.rounds:
            evaluating = run.clock()
            evaluation = run.ledger.final = self.evaluation.evaluate(round_)
            accuracy = self.evaluation.accuracy(evaluation)
            run.events.emit(RoundEvaluated(round_, len(evaluation), (accuracy or {}).get("mean"),
                                           run.clock() - evaluating))
        sent1, received1 = run.channel.counter.snapshot()
        channel = run.channel.counters.snapshot() - channel0
        global_accuracies = [m["global_accuracy"] for m in (evaluation or {}).values() if "global_accuracy" in m]
        sharded = trained.sharded
        refusals = Counter(r.reason.value for r in self.exchange.device_refusals.values())
        record = RoundRecord(
            round=round_,
            selected=trained.selected,
            participants=trained.participants,
            outcome=trained.outcome,
            personalized_accuracy=accuracy,
            global_accuracy=(summarize(global_accuracies) or {}).get("mean"),
            bytes_up=received1 - received0,
            bytes_down=sent1 - sent0,
            seconds=run.clock() - started,
            rejections=channel.rejections,
            replied=trained.replied,
            refused=len(trained.devices.refused),
            device_refusals=dict(sorted(refusals.items())),
            late=len(trained.devices.late),
            missing=len(trained.devices.missing),
            late_folded=trained.folded,
            late_discarded=run.late.discarded - discarded0,
            bytes_down_delivered=run.ledger.delivered_total() - delivered0,
            lost_shards=sorted(sharded.lost) if sharded else [],
            lost_updates=sharded.lost_updates if sharded else 0,
            privacy=run.privacy.record(),
            secagg=asdict(trained.secure) if trained.secure is not None else None,
            asynchronous=trained.step.to_plain() if trained.step is not None else None,
        )
        entry = asdict(record)
        run.position.completed = round_
        run.ledger.rounds.append(entry)
        self.state.checkpoint()
        run.metrics.append({"event": "round", **entry})
        acc = (record.personalized_accuracy or {}).get("mean")
        log.info("%s %d/%d: %s, %d of %d selected aggregated (%d late, %d missing, %d refused), accuracy %s, "
                 "%.2f MB, %.1f s", self.player.label, round_, run.config.training.rounds,
                 record.outcome, record.participants, record.selected, record.late, record.missing, record.refused,
                 f"{acc:.4f}" if acc is not None else "-", (record.bytes_up + record.bytes_down) / 1e6, record.seconds)
        devices = dataclasses.replace(trained.devices, accuracy={d: m["accuracy"] for d, m in sorted(
            (evaluation or {}).items()) if isinstance(m.get("accuracy"), (int, float))})
        run.events.emit(RoundEnded(round_, entry, channel, devices))
