"""`Evaluation`: the devices evaluate what they would deploy, and what of it is released.

An EVALUATE goes to the trainers (and the weak devices once a representation is released);
each accuracy must be plausible. Under DP with private evaluation the accuracies are released
only as a noised mean, accounted; an evaluation outside a round that the budget cannot release
is still played, with no figures (`releasable`). A release phase's pool rides on the same
request (`Pool`; with secure aggregation, the masked shares go to a `SecureRound`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from edge_sdk.channel import Received
from edge_sdk.privacy.disclosure import FIGURES
from edge_sdk.protocol import COORDINATOR, ArrayGroup, Envelope, Kind, ProtocolError, Reason
from edge_sdk.secagg import stages

from ..privacy.budget import BudgetSpent
from ..rounds.collector import RoundCollector
from ..run.report_files import summarize
from .context import RunContext
from .exchange import Exchange

if TYPE_CHECKING:
    from ..releases.phase import Pool
    from ..rounds.secagg import SecureRound

log = logging.getLogger(__name__)


class Evaluation:
    """Plays EVALUATE requests over the run's `Exchange`."""

    def __init__(self, run: RunContext, exchange: Exchange):
        self.run, self.exchange = run, exchange
        self.released = False
        """Whether a representation is released: the weak devices evaluate too."""

    def releasable(self, what: str) -> bool:
        """Whether an evaluation outside a round (`what`) may release its figures: always without
        DP; under DP only within the budget. One that would exceed it is still played (the
        devices fit and deploy their heads) but its devices send no figures, and it is named in
        the log, the event log and metrics.jsonl (`evaluation_withheld`)."""
        run = self.run
        try:
            run.privacy.check_evaluation(what)
        except BudgetSpent as spent:
            log.warning("%s releases no figures: %s", what, spent)
            run.privacy.released_accuracy = None  # the last mean released is not this evaluation's
            run.ledger.event("evaluation_withheld", round=run.completed, evaluation=what)
            run.metrics.append({"event": "evaluation_withheld", "round": run.completed, "evaluation": what,
                                "reason": str(spent), "privacy": run.privacy.record()})
            return False
        return True

    def evaluate(self, round_: int, *, targets: list[str] | None = None, phase: str = "round",
                 pool: Pool | None = None, secure: SecureRound | None = None,
                 extra_groups: dict[str, ArrayGroup] | None = None, figures: bool = True) -> dict[str, dict[str, Any]]:
        """Devices evaluate the model they would deploy on their own test split: the trainers,
        and the weak devices once a representation is released. With a `pool` (a release
        phase), what the devices send in the pool's group is checked and pooled into it; with
        `secure` too, each device's share is a masked vector that `secure` takes instead.
        Without `figures` the devices answer with none (an evaluation the DP budget cannot
        release): nothing is released or accounted."""
        run, exchange = self.run, self.exchange
        if targets is None:
            targets = run.registry.online() if self.released else run.registry.online("trainer")
        if not targets:
            return {}
        run.status("evaluating")
        request = Envelope(Kind.EVALUATE, COORDINATOR, run_id=run.run_id, round=round_,
                           groups={**run.algorithm.eval_groups(), **(extra_groups or {})},
                           config={"selected": targets, "final": round_ >= run.config.training.rounds, "phase": phase,
                                   **({stages.SECURE: True} if secure is not None else {}),
                                   **({} if figures else {FIGURES: False})})
        collector = RoundCollector(round_, frozenset(targets), min_replies=len(targets),
                                   deadline=run.clock() + run.windows()[1], grace=0.0)
        results: dict[str, dict[str, Any]] = {}
        private = run.privacy.releases_evaluations
        evaluates = figures and (pool is None or pool.evaluates)
        released: list[float] = []  # private evaluation: the accuracies released only as a noised mean

        def on_result(received: Received) -> None:
            envelope = received.envelope
            if not exchange.admit(received, Kind.EVAL_RES, round_, collector):
                return
            examples = run.registry.devices[envelope.sender].num_examples
            result: dict[str, Any] = {"kind": run.registry.kind_of(envelope.sender)}
            if evaluates:
                accuracy = envelope.metrics.get("accuracy")
                if not self.plausible_accuracy(accuracy):
                    exchange.refuse(envelope, collector, Reason.MALFORMED,
                                    f"evaluation from {envelope.sender}: accuracy {accuracy!r}")
                    return
                holdout = envelope.sender in run.holdout
                if private:
                    if not holdout and accuracy is not None:
                        released.append(float(accuracy))
                    result.update(holdout=holdout, accuracy=None)
                else:
                    result.update(holdout=holdout, **envelope.metrics)
            elif not figures:  # withheld under DP: the device deployed what it would, and said nothing
                result.update(holdout=envelope.sender in run.holdout, accuracy=None)
            if pool is not None and secure is not None and (pool.required or stages.SECURE in envelope.groups):
                try:
                    secure.on_masked(envelope.sender, envelope.groups)
                except ProtocolError as err:
                    exchange.refuse(envelope, collector, err.reason,
                                    f"{pool.group} from {envelope.sender}: {err.detail}")
                    return
            elif pool is not None and (pool.required or pool.group in envelope.groups):
                try:
                    pool.check(envelope.groups.get(pool.group, {}), examples)
                except ProtocolError as err:
                    exchange.refuse(envelope, collector, err.reason,
                                    f"{pool.group} from {envelope.sender}: {err.detail}")
                    return
                pool.add(envelope.groups[pool.group], examples)
            results[envelope.sender] = result
            collector.accept(envelope.sender, envelope.msg_id, run.clock())

        exchange.request(Kind.EVALUATE, request, collector, on_result)
        exchange.stop_if_every_device_refused("evaluate", round_, targets, results)
        if private and evaluates:
            run.privacy.release_accuracy(released, round_)
        missing = set(targets) - set(results)
        if missing:
            log.warning("round %d evaluation: no result from %s", round_, ", ".join(sorted(missing)))
        return results

    def plausible_accuracy(self, accuracy: Any) -> bool:
        """An accuracy in [0, 1]; under local or distributed DP with private evaluation any finite
        number (each device added its own noise)."""
        if not isinstance(accuracy, (int, float)) or isinstance(accuracy, bool) or not math.isfinite(accuracy):
            return False
        privacy = self.run.privacy
        noised = privacy.devices_noise_evaluations and privacy.releases_evaluations
        return noised or 0.0 <= accuracy <= 1.0

    def accuracy(self, evaluation: dict[str, dict[str, Any]]) -> dict[str, float] | None:
        """The personalized accuracy of the devices not held out: summarized, or (private DP
        evaluation) the noised mean the evaluation released, and how many it is over."""
        privacy = self.run.privacy
        if privacy.releases_evaluations:
            mean = privacy.released_accuracy
            count = sum(1 for m in evaluation.values() if not m.get("holdout"))
            return None if mean is None else {"mean": mean, "count": count}
        return summarize(m["accuracy"] for m in evaluation.values() if not m.get("holdout"))
