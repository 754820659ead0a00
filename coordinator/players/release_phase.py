"""`ReleaseStage`: after training, the released representation, the fleet's final evaluation, FETCH.

The representation is exported (`releases.phase.ReleasePhase` pools what it needs from the trainers:
their sums only, under secure aggregation), kept as the next of the run's numbered releases and
published as the retained RELEASE manifest; then the whole fleet, weak devices included, is
evaluated with the pooled class prototypes sent along (not under DP: no mechanism covers them).
A registered device that asks for the released artifact by its sha256 (FETCH) is sent it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import asdict

from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Reason
from edge_sdk.secagg.errors import SecAggError

from ..events import ReleaseServed
from ..releases.inventory import keep_release_results
from ..releases.phase import Pool, Release, ReleasePhase
from ..releases.store import ReleaseStore
from .context import RunContext
from .evaluation import Evaluation
from .exchange import Exchange
from .run_state import RunState

log = logging.getLogger(__name__)


class ReleaseStage:
    """Releases the run's representation and serves it; `release` is what it released."""

    def __init__(self, run: RunContext, exchange: Exchange, evaluation: Evaluation, state: RunState,
                 device_count: Callable[[], int]):
        self.run, self.exchange, self.evaluation, self.state = run, exchange, evaluation, state
        self.device_count = device_count
        """How many devices registered over the run."""
        self.release: Release | None = None

    def play(self) -> None:
        """Export and publish the representation (`ReleasePhase` pools what it needs); then
        evaluate the whole fleet, weak devices included, sending the pooled prototypes along."""
        run = self.run
        phase = ReleasePhase(run.folder, run.algorithm.context.task.num_classes, self._gather,
                             state=run.algorithm.state, config=self.state.record(), model=run.model,
                             run_id=run.run_id, round_=run.completed)
        phase.pool_body_statistics(run.registry.online("trainer"))
        release = self.release = self._kept(phase.export())
        self.evaluation.released = True
        self.publish(release)
        run.ledger.event("released", round=run.completed, sha256=release.sha256, size=len(release.data))
        run.metrics.append({"event": "release", "round": run.completed, "sha256": release.sha256,
                            "bytes": len(release.data), "path": str(release.path)})
        # under DP the weak devices' class prototypes stay home: no mechanism covers them (under
        # secure aggregation they are summed masked, `_gather`)
        extra = phase.prototypes(run.registry.online("lite"), release) if not run.privacy.private else {}
        final = run.ledger.final = self.evaluation.evaluate(
            run.completed, phase="final", extra_groups=extra,
            figures=self.evaluation.releasable("the release's evaluation"))
        self.state.checkpoint()
        summary = self.evaluation.accuracy(final)
        keep_release_results(run.folder.path, release, final)
        run.metrics.append({"event": "final_evaluation", "round": run.completed, "personalized_accuracy": summary,
                            "devices": len(final), "of_devices": self.device_count()})

    def publish(self, release: Release) -> None:
        """The retained manifest: devices that join (or reconnect) later still see it."""
        run = self.run
        manifest = Envelope(Kind.RELEASE, COORDINATOR, run_id=run.run_id, round=run.completed,
                            config=release.manifest())
        run.outbox.send(run.topics.broadcast(Kind.RELEASE), manifest, retain=True)

    def serve_fetch(self, fetch: Envelope) -> None:
        """Send the released artifact to a registered device that asks for it by sha256."""
        run, release = self.run, self.release
        wanted = fetch.config.get("sha256")
        if fetch.run_id != run.run_id:
            run.outbox.reject(fetch, Reason.WRONG_RUN, f"FETCH from {fetch.sender} for run {fetch.run_id!r}")
        elif fetch.sender not in run.registry.devices:
            run.outbox.reject(fetch, Reason.UNKNOWN_DEVICE, f"FETCH from {fetch.sender}, never registered")
        elif release is None or wanted != release.sha256:
            run.outbox.reject(fetch, Reason.UNKNOWN_ARTIFACT, f"FETCH of {str(wanted)[:16]!r} from {fetch.sender}")
        else:
            artifact = Envelope(Kind.ARTIFACT, COORDINATOR, run_id=run.run_id, round=run.completed,
                                groups=release.artifact(), config={"sha256": release.sha256})
            run.outbox.send(run.topics.down(fetch.sender, Kind.ARTIFACT), artifact)
            run.events.emit(ReleaseServed(fetch.sender, release.sha256, len(release.data), release.version))

    def _kept(self, release: Release) -> Release:
        """`release` kept as the next of the run's numbered releases (`releases/<n>/`)."""
        run = self.run
        kept = ReleaseStore(run.folder.path).add(release.data, release.metadata,
                                                 {"run_id": run.run_id, "round": run.completed}, None,
                                                 f"released by run {run.run_id} after round {run.completed}")
        return dataclasses.replace(release, version=kept.version)

    def _gather(self, targets: list[str], pool: Pool) -> None:
        """Ask `targets` for the pool's phase and pool their replies (their sum only, under
        secure aggregation)."""
        if self.run.config.secagg.secure_aggregation:
            self._secure_gather(targets, pool)
        else:
            self.evaluation.evaluate(self.run.completed, targets=targets, phase=pool.phase, pool=pool)

    def _secure_gather(self, targets: list[str], pool: Pool) -> None:
        """A release pool under secure aggregation (edge_sdk/secagg/pools.py): the `targets`
        advertise keys and share them, answer the pool's EVALUATE with masked vectors of their
        shares, and the survivors unmask the sum, which the pool takes. With fewer than
        MIN_PARTICIPANTS devices, or too few shares to unmask, nothing is pooled (logged, and
        recorded in metrics.jsonl as `secure_pool`)."""
        from ..rounds.secagg import SecureGroups, SecurePool, SecureRound
        from .secure import SecureStages

        run = self.run
        round_ = run.completed
        examples = {device: run.registry.devices[device].num_examples for device in targets}
        largest = max(examples.values(), default=1)
        try:
            part = SecureRound(run.config.secagg, run.run_id, round_, targets, {}, examples, largest=largest,
                               pool=SecurePool(pool.phase, pool.secure_length(),
                                               run.config.secagg.secagg_release_bound))
        except SecAggError as exc:
            log.warning("the %s pool is not gathered: %s", pool.phase, exc)
            run.metrics.append({"event": "secure_pool", "pool": pool.phase, "selected": len(targets),
                                "failed": str(exc)})
            return
        secure = SecureGroups(round_, {0: part}, len(targets), sharded=False)
        secure_stages = SecureStages(run, self.exchange)
        secure_stages.share_keys(secure)
        if secure.rounds:
            secure_stages.deliver_shares(secure)
            self.evaluation.evaluate(round_, targets=sorted(part.server.shared), phase=pool.phase, pool=pool,
                                     secure=part)
            if secure_stages.unmask(secure, lambda device: None):
                pool.add_sum(part.pool_sum(), len(part.server.survivors), largest)
        record = secure.record()
        if record.failed:
            log.warning("the %s pool is not gathered: %s", pool.phase, record.failed)
        run.metrics.append({"event": "secure_pool", "pool": pool.phase, **asdict(record)})
