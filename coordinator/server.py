"""The coordinator: the round loop, wiring an algorithm, the channel and checkpoints.

One round: select devices (seeded) -> broadcast TRAIN once -> collect validated replies until
all / quorum+grace / deadline (both grow with the reply times measured, `rounds.round_windows`)
-> aggregate (with the previous round's late updates under `late_updates = "next_round"`) ->
(evaluate) -> checkpoint -> one metrics line saying who took part (selected, aggregated, refused,
late, missing). There are no algorithm branches here; everything algorithm-specific sits behind
`ServerAlgorithm`. Killed and restarted with the same `--out`, it resumes after the last
checkpointed round and never applies or records a round twice; a run that already played all
its rounds is left as it is (`finished_report`). After a broker reconnection it publishes its
status and the outstanding request again (devices answer a repeated request with their cached
reply, so nothing is trained or applied twice).

The rooms around the loop: `registration` (HELLO, WELCOME, the fleet before round 1),
`shard_rounds` (with `shards` K > 0, the shard aggregators' rosters, notes and partials),
`reporting` (each round's record and the run's report) and `outbox` (what is sent, and the
refusals, answered with a NACK where the sender is registered).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from edge_sdk.channel import Channel, Received
from edge_sdk.config import ConfigError
from edge_sdk.models import ModelSpec
from edge_sdk.privacy.disclosure import FIGURES
from edge_sdk.privacy.upstream import PRIVACY
from edge_sdk.protocol import (COORDINATOR, REFUSABLE_REQUESTS, ArrayGroup, Envelope, Kind, ProtocolError, Reason,
                               Refusal, aggregator_id, new_message_id, refusal_of)
from edge_sdk.secagg import stages
from edge_sdk.secagg.errors import SecAggError

from . import algorithms, checkpoint, warm_start
from .algorithms.base import ServerContext
from .async_steps import AsyncSteps, StepRecord, check_async_run, rebase, staleness_factor
from .config import RunConfig
from .devices import DeviceRegistry
from .events import (DeviceOffline, DeviceOnline, DeviceRefused, Event, EventBus, ReleaseServed, RoundAggregated,
                     RoundDevices, RoundEnded, RoundEvaluated, RoundStarted, RunStarted, UpdateAccepted)
from .ledger import Ledger
from .nacks import NackLimiter
from .outbox import Outbox, RunPosition, resent
from .privacy.budget import BudgetSpent
from .privacy.policy import check_dp_sgd_run, private_run
from .registration import Registration, RegistrationTimeout
from .release import Pool, Release, ReleasePhase
from .releases.inventory import keep_release_results
from .releases.store import ReleaseStore
from .report import MetricsLog, summarize, write_report
from .reporting import RoundRecord, finished_report, played_report, run_report
from .rounds import LateUpdates, Outcome, RoundCollector, every_device_refused, round_windows, select_clients
from .run_folder import RunFolder
from .shard_rounds import ShardedRounds
from .sharding import AGGREGATOR, ShardRound, check_shardable, shard_of
from .validation import UpdateLimits, check_upload_codec, checked_update

if TYPE_CHECKING:
    from .secure_rounds import SecureGroups, SecureRound, SecureRoundRecord

__all__ = ["Coordinator", "RegistrationTimeout", "RoundRecord", "finished_report"]

log = logging.getLogger(__name__)

REPLY_KINDS = {Kind.TRAIN: Kind.TRAIN_RES, Kind.EVALUATE: Kind.EVAL_RES, Kind.SECAGG: Kind.SECAGG_RES}
"""The reply kind of each request kind."""


@dataclass(frozen=True)
class TrainedRound:
    """What a round's training (or an async aggregation step) gave its record: devices asked,
    updates aggregated, how it ended, and who replied, was refused, late or missing."""

    selected: int
    participants: int
    outcome: str
    replied: int
    devices: RoundDevices
    folded: int = 0
    sharded: ShardRound | None = None
    secure: SecureRoundRecord | None = None
    step: StepRecord | None = None


class Coordinator:
    """Runs one federated training over a `Channel`; `run()` returns the report. Observers
    `subscribe` to its events (coordinator/events.py); `on_round` receives each round's record.

    `expected_devices` names devices the run expects (a simulation's: dev000, dev001, ...): what
    the algorithm hands out in order of registration (FediOS's projection blocks, DC-PFL's body
    models) is handed out to them in that order before registration opens, so it does not depend
    on the order their HELLOs arrive in (devices on several hosts). Not the ROSTER message, which
    tells a shard aggregator a round's devices. `partition` is how the devices' data was split when
    this process split it (a simulation) or was told so; without it the report says only what the
    devices reported of their data."""

    def __init__(
        self,
        config: RunConfig,
        channel: Channel,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        model: ModelSpec | None = None,
        expected_devices: Sequence[str] = (),
        partition: str | None = None,
    ):
        self.config = config
        self.expected_devices = tuple(expected_devices)
        self.partition = partition
        self.model: ModelSpec = model if model is not None else config.model_name
        self.channel = channel
        self.topics = channel.topics
        self.clock = clock
        self.events = EventBus()
        if on_round is not None:
            self.events.subscribe(lambda event: on_round(event.record), RoundEnded)
        self.folder = RunFolder(config.run.out)
        self.registry = DeviceRegistry()
        algorithm_cls = algorithms.load(config.run.algorithm)
        check_shardable(algorithm_cls, config.aggregation.rule, config.round.shards)
        check_async_run(config, algorithm_cls)
        check_upload_codec(config.training.upload_codec, algorithm_cls)
        if config.secagg.secure_aggregation:  # cryptography loads with a secure run only
            from .secure_rounds import check_secure_run

            check_secure_run(config, algorithm_cls)
        self.hyper = algorithms.hyperparameters(config.run.algorithm, config.hyper)
        context = ServerContext(self.model, config.task(), config.training.seed, config.training.rounds,
                                config.run.clients, config.aggregation)
        self.algorithm = algorithm_cls(self.hyper, context)
        if config.run.release and not self.algorithm.shares_body():
            raise ConfigError(f"release: {config.run.algorithm} keeps the body personal (all of it or some of its "
                              "layers or channels), there is no whole global representation to release")
        check_dp_sgd_run(config, self.model)
        self.privacy = private_run(config, self.algorithm, self.model, self._record())
        self.limits = UpdateLimits(config.round.max_examples, config.round.max_update_norm,
                                   weighted=self.privacy is None)
        self.incarnation = new_message_id()[:12]
        self.metrics = MetricsLog(self.folder.metrics)
        self.position = RunPosition(new_message_id()[:16])
        self.holdout: frozenset[str] = frozenset()
        self._collector: RoundCollector | None = None
        self._refusals: dict[str, str] = {}  # device -> why its answer was rejected, this round
        self._device_refusals: dict[str, Refusal] = {}  # device -> why it refused the request, this round
        self._outstanding: tuple[str, Envelope] | None = None  # the request being collected
        self._status_state = "registering"
        self._connections = getattr(channel.transport, "connections", 0)
        self.release: Release | None = None
        self.late = LateUpdates(config.round.late_updates)
        self.nacks = NackLimiter(clock)
        self._slowest_reply: float | None = None  # seconds from a round's start to an accepted update
        self._started = time.time()
        history = self._resume()
        settings = config.round
        self.steps = AsyncSteps(buffer=settings.buffer, max_staleness=settings.max_staleness,
                                concurrency=settings.concurrency, exponent=settings.staleness_exponent,
                                seed=config.training.seed, version=self.completed) if settings.mode == "async" else None
        """Under `mode async`: the devices in flight and the versions they train on (None: rounds)."""
        self._step_open = False  # async: the algorithm's accumulators take the next step's arrivals
        self._step_replied: list[str] = []  # async: the devices whose updates the open step folded, in order
        self._step_missing: set[str] = set()  # async: devices in flight that went offline during the step
        self.algorithm.state, self.init_from = warm_start.apply(config.run.init_from, self.algorithm.state,
                                                                history)
        """What a run with `init_from` started from (`WarmStart.record`); None for a cold start."""
        self.ledger = Ledger(channel, history)
        self.outbox = Outbox(channel, self.registry, self.ledger, self.position, self.nacks)
        self.registration = Registration(config, self.algorithm, self.hyper, self.model, self.limits, self.registry,
                                         self.outbox, self.ledger, self.incarnation, privacy=self._announced_privacy(),
                                         data_private=self.privacy is not None)
        self.sharding = ShardedRounds(config.round.shards, self.algorithm, self.limits, self.registry, self.outbox,
                                      self.ledger, clock)
        for client_id in self.expected_devices:  # before any HELLO: assignments in their order
            self.algorithm.assignment(client_id)

    @property
    def run_id(self) -> str:
        return self.position.run_id

    @property
    def completed(self) -> int:
        """Rounds completed and checkpointed."""
        return self.position.completed

    def subscribe(self, callback: Callable[[Event], None], *kinds: type) -> None:
        """Call `callback(event)` for each event of the given types (every event without any)."""
        self.events.subscribe(callback, *kinds)

    def welcome(self, client_id: str) -> Envelope:
        """The WELCOME `client_id` receives when it registers (`Registration.welcome`)."""
        return self.registration.welcome(client_id)

    def _announced_privacy(self) -> dict[str, Any] | None:
        """The `[privacy]` settings WELCOME carries: under DP (user-level, the noise multiplier
        resolved) or DP-SGD; None without either."""
        if self.privacy is not None:
            return self.privacy.announcement()
        return asdict(self.config.privacy) if self.config.privacy.dp_sgd else None

    # -- checkpoints -----------------------------------------------------------------------
    def _resume(self) -> dict[str, Any] | None:
        saved = checkpoint.load(self.folder.checkpoint)
        if saved is None:
            return None
        if saved.fingerprint != self.config.fingerprint():
            raise checkpoint.CheckpointError(
                f"{self.folder.path} holds run {saved.run_id} with other settings; use another --out to start a new run"
            )
        self.position.run_id, self.position.completed = saved.run_id, saved.round
        self.algorithm.state = saved.state
        if self.privacy is not None:
            self.privacy.restore(saved.history["privacy"])
        for record in saved.history["rounds"]:  # a crash between checkpoint and log line
            self.metrics.append({"event": "round", **record})
        log.info("resuming run %s after round %d of %d", self.run_id, self.completed, self.config.training.rounds)
        return saved.history

    def _record(self) -> dict[str, Any]:
        """The run's configuration as its checkpoint records it: every setting by its flat key,
        and the task the run resolved."""
        return {**self.config.to_flat(), "task": self.config.task().to_plain()}

    def _checkpoint(self) -> None:
        history = {**self.ledger.to_history(self._wall_seconds()), "config": self._record()}
        if self.privacy is not None:
            history["privacy"] = self.privacy.to_state()
        if self.init_from is not None:
            history[warm_start.KEY] = self.init_from
        checkpoint.save(
            self.folder.checkpoint,
            checkpoint.Checkpoint(self.run_id, self.completed, self.config.fingerprint(), self.algorithm.state,
                                  history),
        )

    def _wall_seconds(self) -> float:
        """The run's wall time over every incarnation so far."""
        return self.ledger.base_wall_seconds + time.time() - self._started

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Play the rounds left, evaluate, release if asked, and return the report (also written).
        A run that already played all its rounds is not touched: its report is returned."""
        rounds = self.config.training.rounds
        played = sum(r["bytes_up"] + r["bytes_down"] for r in self.ledger.rounds)
        self.events.emit(RunStarted(self.run_id, self.completed, rounds, played))
        done = played_report(self.folder, self.run_id, self.completed, rounds)
        if done is not None:
            log.info("run %s already finished all %d rounds; nothing changed", self.run_id, rounds)
            return done
        self._started = time.time()
        self.ledger.event("started", incarnation=self.incarnation, after_round=self.completed)
        self.channel.transport.subscribe(self.topics.all_up())
        self._status("registering")
        self.holdout = self.registration.await_fleet(lambda timeout: self._serve(timeout, self._stale_reply),
                                                     self.clock, self.events)
        stopped = None
        for round_ in range(self.completed + 1, self.config.training.rounds + 1):
            try:
                self._play_round(round_)
            except BudgetSpent as spent:
                stopped = str(spent)
                log.warning("stopped before round %d: %s (a resume needs a larger --dp-epsilon)", round_, stopped)
                self.ledger.event("budget_spent", round=round_)
                self.metrics.append({"event": "budget_spent", "round": round_, "privacy": self.privacy.record()
                                     if self.privacy else None, "reason": stopped})
                break
        if stopped is None and not self.ledger.final and self.completed >= self.config.training.rounds:
            # resumed after the last round: its final evaluation is released only within the budget
            self.ledger.final = self._evaluate(self.completed, figures=self._releasable("the final evaluation"))
            self._checkpoint()  # with what its release added to the accountant
        if stopped is None and (self.config.run.release or self.algorithm.releases_representation):
            self._release_phase()
        report = run_report(self.config, self.hyper, run_id=self.run_id, completed=self.completed,
                            ledger=self.ledger, release=self.release, devices=self.registry.devices.values(),
                            devices_registered=self.registration.device_count(), partition=self.partition,
                            wall_seconds=self._wall_seconds(),
                            privacy=self.privacy.report() if self.privacy else None, stopped=stopped,
                            init_from=self.init_from)
        write_report(self.folder, report)
        self._status("finished")
        return report

    def _status(self, state: str) -> None:
        """Publish the retained STATUS; while registering it carries the settings that define the
        run (`RunConfig.defining`), which `edgepfl workers` checks its own against."""
        self._status_state = state
        config = {"state": state, "incarnation": self.incarnation, "epoch": self._connections,
                  "rounds": self.config.training.rounds, "algorithm": self.config.run.algorithm}
        if state == "registering":
            config["settings"] = self.config.defining()
        if self.privacy is not None:  # before its HELLO, a device learns what it must keep to itself
            config[PRIVACY] = self.privacy.announcement()
        if self.config.secagg.secure_aggregation:  # and, under secure aggregation, which counts it withholds
            config[stages.SECURE] = True
        envelope = Envelope(Kind.STATUS, COORDINATOR, run_id=self.run_id, round=self.completed, config=config)
        self.outbox.send(self.topics.broadcast(Kind.STATUS), envelope, retain=True)

    # -- message handling ------------------------------------------------------------------
    def _serve(self, timeout: float, on_reply: Callable[[Received], None]) -> None:
        """Handle at most one message: registrations and liveness here, replies to `on_reply`."""
        self._check_reconnection()
        received = self.channel.receive(max(0.0, timeout))
        if received is None:
            return
        try:
            self._handle(received, on_reply)
        finally:
            del received  # gone before the network thread reads the next message
            self.channel.release()

    def _handle(self, received: Received, on_reply: Callable[[Received], None]) -> None:
        envelope = received.envelope
        if envelope.kind is Kind.HELLO:
            self._hello(envelope)
        elif envelope.kind is Kind.OFFLINE:
            self._offline(envelope.sender)
        elif envelope.kind is Kind.FETCH:
            self._serve_fetch(envelope)
        elif envelope.kind in (Kind.TRAIN_RES, Kind.EVAL_RES, Kind.SECAGG_RES):
            if envelope.run_id != self.run_id:
                self._reject_reply(envelope, Reason.WRONG_RUN, f"{envelope.kind.value} from {envelope.sender}: run "
                                                              f"{envelope.run_id!r}")
            elif envelope.sender not in self.registry.devices:
                self.outbox.reject(envelope, Reason.UNKNOWN_DEVICE, f"{envelope.sender} never registered")
            elif envelope.kind is Kind.TRAIN_RES and self.steps is not None:
                self._arrival(received)
            elif envelope.kind is Kind.TRAIN_RES and self.late.expects(envelope.sender, envelope.round,
                                                                      envelope.config.get("in_reply_to")):
                self._late_update(envelope)
            else:
                on_reply(received)
        elif envelope.kind in (Kind.NOTE, Kind.PARTIAL):
            self.sharding.on_message(envelope)

    def _hello(self, hello: Envelope) -> None:
        """Register the sender (`Registration.on_hello`); a registration refreshes its Device.
        A device the open request still waits for gets that request again on its own topic: it
        says HELLO after a reconnection, and a broadcast published while it was away is lost."""
        before = self.registry.devices.get(hello.sender)
        self.registration.on_hello(hello)
        after = self.registry.devices.get(hello.sender)
        if after is not None and after is not before:
            self.events.emit(DeviceOnline(hello.sender, after.kind, len(self.registry.online()),
                                          self.registration.device_count()))
            if self._outstanding is not None and self._collector is not None and self._collector.rejoined(hello.sender):
                request = self._outstanding[1]
                self.outbox.send(self.topics.down(hello.sender, request.kind), resent(request))
            elif self.steps is not None and (flight := self.steps.flights.get(hello.sender)) is not None:
                self.outbox.send(self.topics.down(hello.sender, Kind.TRAIN), resent(flight.request))

    def _check_reconnection(self) -> None:
        """After the broker connection came back, publish what devices may have missed."""
        transport = self.channel.transport
        connections = getattr(transport, "connections", 0)
        if connections == self._connections:
            return
        if not getattr(transport, "subscriptions_active", lambda: True)():
            return  # not yet: the replies to what is published again must find the coordinator listening
        self._connections = connections
        log.warning("broker connection re-established; publishing status and the open request again")
        self.ledger.event("coordinator_reconnected", round=self.completed + 1)
        self._status(self._status_state)
        if self.release is not None:
            self._publish_release(self.release)
        if self._outstanding is not None:
            topic, request = self._outstanding
            self.outbox.send(topic, resent(request))

    def _serve_fetch(self, fetch: Envelope) -> None:
        """Send the released artifact to a registered device that asks for it by sha256."""
        wanted = fetch.config.get("sha256")
        if fetch.run_id != self.run_id:
            self.outbox.reject(fetch, Reason.WRONG_RUN, f"FETCH from {fetch.sender} for run {fetch.run_id!r}")
        elif fetch.sender not in self.registry.devices:
            self.outbox.reject(fetch, Reason.UNKNOWN_DEVICE, f"FETCH from {fetch.sender}, never registered")
        elif self.release is None or wanted != self.release.sha256:
            self.outbox.reject(fetch, Reason.UNKNOWN_ARTIFACT, f"FETCH of {str(wanted)[:16]!r} from {fetch.sender}")
        else:
            artifact = Envelope(Kind.ARTIFACT, COORDINATOR, run_id=self.run_id, round=self.completed,
                                groups=self.release.artifact(), config={"sha256": self.release.sha256})
            self.outbox.send(self.topics.down(fetch.sender, Kind.ARTIFACT), artifact)
            self.events.emit(ReleaseServed(fetch.sender, self.release.sha256, len(self.release.data),
                                            self.release.version))

    def _late_update(self, envelope: Envelope) -> None:
        """An update of the last closed round from a device it stopped waiting for: dropped
        (counted), or checked against what its round sent and kept for the next round."""
        round_ = self.late.round
        if not self.late.folds:
            self.late.discard(envelope.sender)
            log.info("round %d: late update from %s discarded (late_updates = discard)", round_, envelope.sender)
            return
        registered = self.registry.devices[envelope.sender].num_examples
        try:
            groups, weight = checked_update(self.algorithm, round_, envelope, self.late.sent, registered, self.limits,
                                            self.config.training.upload_codec)
        except ProtocolError as err:
            self.late.arrived(envelope.sender)
            self.outbox.reject(envelope, err.reason, f"late update from {envelope.sender}: {err.detail}")
            return
        self.late.keep(envelope.sender, groups, envelope.metrics, weight)
        log.info("round %d: late update from %s kept for round %d", round_, envelope.sender, round_ + 1)

    def _stale_reply(self, received: Received) -> None:
        envelope = received.envelope
        self.outbox.reject(envelope, Reason.STALE,
                           f"{envelope.kind.value} from {envelope.sender} for round {envelope.round}")

    def _offline(self, client_id: str) -> None:
        device = self.registry.devices.get(client_id)
        was_online = device is not None and device.online
        self.registration.went_offline(client_id)
        if was_online:
            self.events.emit(DeviceOffline(client_id, len(self.registry.online())))
        if self._collector is not None:
            self._collector.mark_offline(client_id, self.clock())
        if self.steps is not None and client_id in self.steps.flights:
            self.steps.lost(client_id)
            self._step_missing.add(client_id)
        self.sharding.aggregator_offline(client_id)

    # -- requests and their replies --------------------------------------------------------
    def _request(self, kind: Kind, envelope: Envelope, collector: RoundCollector,
                 on_reply: Callable[[Received], None]) -> Outcome:
        """Broadcast a request and collect the replies until the collector says the round is over."""
        if kind in (Kind.TRAIN, Kind.EVALUATE):
            self.algorithm.check_outgoing(f"the {kind.value} of round {envelope.round}", envelope.groups)
        self._outstanding = (self.topics.broadcast(kind), envelope)
        self._collector = collector
        self.outbox.send(*self._outstanding)
        try:
            while (outcome := collector.outcome(self.clock())) is Outcome.OPEN:
                self._serve(min(1.0, collector.time_left(self.clock())), on_reply)
            return outcome
        finally:
            self._collector = None
            self._outstanding = None

    def _admit(self, received: Received, kind: Kind, round_: int, collector: RoundCollector) -> bool:
        """Round, kind, selection and duplicate checks common to every reply."""
        envelope = received.envelope
        request = self._outstanding[1] if self._outstanding else None
        if (envelope.kind is not kind or envelope.round != round_ or request is None
                or envelope.config.get("in_reply_to") != request.msg_id):
            self._reject_reply(envelope, Reason.STALE, f"{envelope.kind.value} from {envelope.sender} for round "
                                                       f"{envelope.round} is not a reply to the open request")
            return False
        reason = collector.check(envelope.sender, envelope.msg_id)
        if reason is Reason.DUPLICATE:
            self.channel.count_duplicate()
            return False
        if reason is not None:
            self.outbox.reject(envelope, reason, f"{envelope.kind.value} from {envelope.sender} in round {round_}")
            return False
        return not self._device_refused(envelope, collector)

    def _device_refused(self, envelope: Envelope, collector: RoundCollector | None) -> bool:
        """A reply that says its device refused the request it answers (`refused`, `detail`):
        that device's answer, counted and logged under its reason (and, with the open request's
        `collector`, not waited for); True if it was one. A malformed refusal is refused as such."""
        if envelope.kind not in REFUSABLE_REQUESTS.values():  # a SECAGG_RES says its refusal its own way (§19)
            return False
        try:
            refusal = refusal_of(envelope)
        except ProtocolError as err:
            detail = f"{envelope.kind.value} from {envelope.sender}: {err.detail}"
            if collector is not None:
                self._refuse(envelope, collector, err.reason, detail)
            else:
                self._refusals[envelope.sender] = err.reason.value
                self.outbox.reject(envelope, err.reason, detail)
            return True
        if refusal is None:
            return False
        log.warning("%s refused the %s of round %d (%s): %s", envelope.sender,
                    "train" if envelope.kind is Kind.TRAIN_RES else "evaluate", envelope.round, refusal.reason.value,
                    refusal.detail)
        if collector is not None:
            collector.refuse(envelope.sender, envelope.msg_id)
        self._refusals[envelope.sender] = refusal.reason.value
        self._device_refusals[envelope.sender] = refusal
        self.events.emit(DeviceRefused(envelope.round, envelope.sender, refusal.reason.value, refusal.detail))
        return True

    def _stop_if_every_device_refused(self, what: str, round_: int, asked: Iterable[str],
                                      answered: Iterable[str]) -> None:
        """Stop the run (`EveryDeviceRefused`) when every device asked refused the request itself
        and none answered it: the next round would send the same and be refused the same."""
        stop = every_device_refused(what, round_, asked, answered, self._device_refusals)
        if stop is not None:
            raise stop

    def _refuse(self, envelope: Envelope, collector: RoundCollector, reason: Reason, detail: str) -> None:
        """Reject a device's answer to the open request; it sends no other, so it is not waited for."""
        self.outbox.reject(envelope, reason, detail)
        collector.refuse(envelope.sender, envelope.msg_id)
        self._refusals[envelope.sender] = reason.value

    def _reject_reply(self, envelope: Envelope, reason: Reason, detail: str) -> None:
        """Refuse a TRAIN_RES or EVAL_RES that fails the reply check. If it answers the open
        request (`_answers_open_request`) and its sender is one the request still waits for, it
        is that device's answer, refused: the request stops waiting for it."""
        collector = self._collector
        if (collector is not None and self._answers_open_request(envelope)
                and collector.check(envelope.sender, envelope.msg_id) is None):
            self._refuse(envelope, collector, reason, detail)
        else:
            self.outbox.reject(envelope, reason, detail)

    def _answers_open_request(self, envelope: Envelope) -> bool:
        """A reply is meant for the open request when it names it (`in_reply_to` = its msg_id),
        or names none (no str `in_reply_to`) while its kind and round are those of the request's
        replies; a reply naming another request is not."""
        if self._outstanding is None:
            return False
        request = self._outstanding[1]
        named = envelope.config.get("in_reply_to")
        if isinstance(named, str):
            return named == request.msg_id
        return envelope.kind is REPLY_KINDS.get(request.kind) and envelope.round == request.round

    # -- one round -------------------------------------------------------------------------
    def _play_round(self, round_: int) -> None:
        started, (sent0, received0) = self.clock(), self.channel.counter.snapshot()
        channel0 = self.channel.counters.snapshot()
        delivered0, discarded0 = self.ledger.delivered_total(), self.late.discarded
        self._refusals.clear()
        self._device_refusals.clear()
        if self.steps is not None:
            trained = self._async_step(round_, started)
        else:
            trained = self._synchronous_round(round_, started)
        evaluation = None
        accuracy: dict[str, float] | None = None
        if round_ % self.config.round.eval_every == 0 or round_ == self.config.training.rounds:
            evaluating = self.clock()
            evaluation = self.ledger.final = self._evaluate(round_)
            accuracy = self._accuracy(evaluation)
            self.events.emit(RoundEvaluated(round_, len(evaluation), (accuracy or {}).get("mean"),
                                            self.clock() - evaluating))
        sent1, received1 = self.channel.counter.snapshot()
        channel = self.channel.counters.snapshot() - channel0
        global_accuracies = [m["global_accuracy"] for m in (evaluation or {}).values() if "global_accuracy" in m]
        sharded = trained.sharded
        record = RoundRecord(
            round=round_,
            selected=trained.selected,
            participants=trained.participants,
            outcome=trained.outcome,
            personalized_accuracy=accuracy,
            global_accuracy=(summarize(global_accuracies) or {}).get("mean"),
            bytes_up=received1 - received0,
            bytes_down=sent1 - sent0,
            seconds=self.clock() - started,
            rejections=channel.rejections,
            replied=trained.replied,
            refused=len(trained.devices.refused),
            device_refusals=dict(sorted(Counter(r.reason.value for r in self._device_refusals.values()).items())),
            late=len(trained.devices.late),
            missing=len(trained.devices.missing),
            late_folded=trained.folded,
            late_discarded=self.late.discarded - discarded0,
            bytes_down_delivered=self.ledger.delivered_total() - delivered0,
            lost_shards=sorted(sharded.lost) if sharded else [],
            lost_updates=sharded.lost_updates if sharded else 0,
            privacy=self.privacy.record() if self.privacy else None,
            secagg=asdict(trained.secure) if trained.secure is not None else None,
            asynchronous=trained.step.to_plain() if trained.step is not None else None,
        )
        entry = asdict(record)
        self.position.completed = round_
        self.ledger.rounds.append(entry)
        self._checkpoint()
        self.metrics.append({"event": "round", **entry})
        acc = (record.personalized_accuracy or {}).get("mean")
        log.info("%s %d/%d: %s, %d of %d selected aggregated (%d late, %d missing, %d refused), accuracy %s, "
                 "%.2f MB, %.1f s", "step" if self.steps is not None else "round", round_, self.config.training.rounds,
                 record.outcome, record.participants, record.selected, record.late, record.missing, record.refused,
                 f"{acc:.4f}" if acc is not None else "-", (record.bytes_up + record.bytes_down) / 1e6, record.seconds)
        devices = dataclasses.replace(trained.devices, accuracy={d: m["accuracy"] for d, m in sorted(
            (evaluation or {}).items()) if isinstance(m.get("accuracy"), (int, float))})
        self.events.emit(RoundEnded(round_, entry, channel, devices))

    def _synchronous_round(self, round_: int, started: float) -> TrainedRound:
        """Select the round's devices, train them (securely if asked) and aggregate."""
        candidates = self._await_trainers(max(1, self.config.round.min_clients))
        if self.privacy is not None:
            self.privacy.check_budget(len(candidates))
            selected = self.privacy.select(candidates, round_)
            if not self.privacy.distributed:  # distributed: the secure sum over the fixed denominator
                self.algorithm.private_mean = self.privacy.aggregator(len(candidates), round_)
        else:
            selected = select_clients(candidates, self.config.round.fraction, self.config.training.seed, round_)
        self.events.emit(RoundStarted(round_, tuple(selected)))
        self._status("training")
        if self.config.secagg.secure_aggregation:
            collector, outcome, aggregated, secure = self._secure_train(round_, selected, started, len(candidates))
            folded, sharded = 0, None
        else:
            collector, outcome, folded, sharded = self._train(round_, selected, started, len(candidates))
            aggregated, secure = collector.enough, None
        if self.privacy is not None:
            self.privacy.round_ended(len(candidates), selected, round_)
        self._stop_if_every_device_refused("train", round_, selected, collector.replied)
        devices = RoundDevices(replied=tuple(sorted(collector.replied)),
                               refused={d: self._refusals.get(d, "refused") for d in sorted(collector.refused)},
                               late=tuple(sorted(collector.waiting)), missing=tuple(sorted(collector.offline)),
                               accuracy={})
        return TrainedRound(len(selected), len(collector.replied) if aggregated else 0,
                            outcome.value if aggregated else "aborted", len(collector.replied), devices,
                            folded=folded, sharded=sharded, secure=secure)

    # -- one asynchronous aggregation step ---------------------------------------------------
    def _async_step(self, step: int, started: float) -> TrainedRound:
        """Keep up to `concurrency` devices training on the latest state, fold arrivals in as
        they come (`_arrival`), and close the step once `buffer` of them are in, or at the
        timeout with those in (aborted with none)."""
        steps = self.steps
        assert steps is not None
        if not self._step_open:  # the first step of this process; later ones open as the one before closes
            self.algorithm.begin_round(step)
            self._step_open = True
        self._status("training")
        deadline = started + self._windows()[1]
        while not steps.full and (left := deadline - self.clock()) > 0:
            for device in steps.expired(self.clock(), self._windows()[1]):
                log.info("step %d: %s has trained for longer than the timeout; asked again", step, device)
            self._dispatch(step)
            self._serve(min(1.0, left), self._stale_reply)
            if self._device_refusals and not steps.step.arrivals:  # only once a device refused
                self._stop_if_every_device_refused("train", step, self._trainers_online(), ())
        arrivals = steps.step.arrivals
        if arrivals:
            aggregating = self.clock()
            self.algorithm.close_round(step)
            self.events.emit(RoundAggregated(step, arrivals, self.clock() - aggregating))
        else:
            log.warning("step %d: no update arrived within %.0f s; global state unchanged", step, self._windows()[1])
        record = steps.close_step()
        self.algorithm.begin_round(step + 1)  # arrivals from now on, during the evaluation too, go to the next step
        replied, missing = tuple(self._step_replied), tuple(sorted(self._step_missing))
        self._step_replied, self._step_missing = [], set()
        outcome = "aborted" if not arrivals else ("complete" if arrivals >= steps.buffer else Outcome.DEADLINE.value)
        devices = RoundDevices(replied=replied, refused=dict(sorted(self._refusals.items())), missing=missing)
        return TrainedRound(record.dispatched, arrivals, outcome, arrivals, devices, step=record)

    def _dispatch(self, step: int) -> None:
        """Send the current state to the idle online trainers that may start now: one TRAIN, on
        each one's own topic, so that no device downloads a model it was not asked to train."""
        steps = self.steps
        assert steps is not None
        devices = steps.to_dispatch(self._trainers_online())
        if not devices:
            return
        groups = self.algorithm.task_groups(step)
        self.algorithm.check_outgoing(f"the train of step {step}", groups)
        task = Envelope(Kind.TRAIN, COORDINATOR, run_id=self.run_id, round=step, groups=groups,
                        config={"selected": devices, "version": steps.version, **self._task_config(step, len(devices))})
        steps.dispatched(devices, task, self.clock())
        self.events.emit(RoundStarted(step, tuple(devices)))
        for device in devices:
            self.outbox.send(self.topics.down(device, Kind.TRAIN), task)

    def _arrival(self, received: Received) -> None:
        """An update under `mode async`: it must end the flight its device is on; too stale, it is
        refused (`too_stale`); else checked against what its version sent, rebased on the
        current state with its staleness weight and folded into the open step."""
        steps = self.steps
        assert steps is not None
        envelope = received.envelope
        flight = steps.flight_of(envelope.sender, envelope.config.get("in_reply_to"))
        if flight is None:
            self.outbox.reject(envelope, Reason.STALE, f"update from {envelope.sender} answers no request it is "
                                                       "training on")
            return
        if steps.version >= self.config.training.rounds:  # it was training when the last step closed
            steps.land(flight)
            self.late.discard(envelope.sender)
            log.info("update from %s arrived after the last aggregation step; discarded", envelope.sender)
            return
        staleness, sent = steps.land(flight)
        if self._device_refused(envelope, None):
            return
        if sent is None:
            self._refusals[envelope.sender] = Reason.TOO_STALE.value
            self.outbox.reject(envelope, Reason.TOO_STALE, f"update from {envelope.sender} of version "
                                                           f"{flight.version}, {staleness} behind (max_staleness "
                                                           f"{steps.max_staleness})")
            return
        registered = self.registry.devices[envelope.sender].num_examples
        validating = self.clock()
        try:
            groups, weight = checked_update(self.algorithm, envelope.round, envelope, sent, registered, self.limits,
                                            self.config.training.upload_codec)
        except ProtocolError as err:
            self._refusals[envelope.sender] = err.reason.value
            self.outbox.reject(envelope, err.reason, f"update from {envelope.sender}: {err.detail}")
            return
        accumulating = self.clock()
        current = self.algorithm.task_groups(steps.version)
        self.algorithm.accumulate(envelope.sender, rebase(groups, sent, current,
                                                          staleness_factor(staleness, steps.exponent)),
                                  envelope.metrics, weight)
        steps.folded(staleness)
        self._step_replied.append(envelope.sender)
        now = self.clock()
        self._slowest_reply = max(self._slowest_reply or 0.0, now - flight.started)
        self.events.emit(UpdateAccepted(self.completed + 1, envelope.sender, received.size, now - flight.started,
                                        accumulating - validating, now - accumulating))

    def _await_trainers(self, wanted: int) -> list[str]:
        """The online trainers a round may select, once `wanted` of them are online or the round
        timeout passed: in a fleet whose devices come and go, a round waits for a quorum to be
        there instead of closing at once with nobody selected."""
        deadline = self.clock() + self._windows()[1]
        if len(self._trainers_online()) < wanted:
            log.info("waiting for %d online trainers (%d now) before the next round", wanted,
                     len(self._trainers_online()))
        while len(self._trainers_online()) < wanted and (left := deadline - self.clock()) > 0:
            self._serve(min(1.0, left), self._stale_reply)
        return self._trainers_online()

    def _trainers_online(self) -> list[str]:
        """The online trainers that may train: all but the held-out ones."""
        return [c for c in self.registry.online("trainer") if c not in self.holdout]

    def _windows(self) -> tuple[float, float]:
        """(grace, timeout) of the next request, from the settings and the replies measured."""
        settings = self.config.round
        return round_windows(settings.quorum_grace, settings.round_timeout, settings.patience, self._slowest_reply)

    def _task_config(self, round_: int, eligible: int) -> dict[str, Any]:
        """What a round's TRAIN config carries beyond `selected`: the algorithm's keys, and the
        round's DP (of a sample drawn from `eligible` trainers)."""
        return {**self.algorithm.task_config(round_),
                **(self.privacy.task_config(eligible) if self.privacy is not None else {})}

    def _train(self, round_: int, selected: list[str], started: float,
               eligible: int) -> tuple[RoundCollector, Outcome, int, ShardRound | None]:
        """Broadcast TRAIN, fold the replies in (and the previous round's late updates kept for
        this one), aggregate; returns the collector, the outcome, how many late updates were
        folded and, sharded, the round's shards. What was broadcast is let go on return, before
        evaluation and the checkpoint (kept only while late updates may be folded against it)."""
        self.algorithm.begin_round(round_)
        groups = self.algorithm.task_groups(round_)
        task = Envelope(Kind.TRAIN, COORDINATOR, run_id=self.run_id, round=round_, groups=groups,
                        config={"selected": selected, **self._task_config(round_, eligible)})
        grace, timeout = self._windows()
        collector = RoundCollector(
            round_,
            frozenset(selected),
            min_replies=max(1, min(self.config.round.min_clients, len(selected))),
            deadline=self.clock() + timeout,
            grace=grace,
            rejoin=self.config.round.quorum_grace,
        )
        sharded: ShardRound | None = None
        on_update: Callable[[Received], None]
        if self.sharding.shards:
            sharded = self.sharding.open(round_, selected, task.msg_id, collector)
            on_update = self._misrouted_update
        else:
            def on_update(received: Received) -> None:
                self._on_update(received, round_, groups, collector, started)
        try:
            outcome = self._request(Kind.TRAIN, task, collector, on_update)
            if sharded is not None:
                self.sharding.gather(sharded, self._windows()[1],
                                     lambda timeout: self._serve(timeout, self._stale_reply))
        finally:
            self.sharding.close()
        late = self.late.take(frozenset(collector.replied), aggregating=collector.enough)
        if collector.enough:
            aggregating = self.clock()
            for update in late:
                self.algorithm.accumulate(update.sender, update.groups, update.metrics, update.weight)
            self.algorithm.close_round(round_)
            self.events.emit(RoundAggregated(round_, len(collector.replied) + len(late), self.clock() - aggregating))
        else:
            log.warning("round %d: %d of %d replies, below the quorum of %d; nothing aggregated, global state "
                        "unchanged", round_, len(collector.replied), len(selected), collector.min_replies)
        self.late.close(round_, task.msg_id, groups, collector.waiting)
        return collector, outcome, len(late), sharded

    def _secure_train(self, round_: int, selected: list[str], started: float,
                      eligible: int) -> tuple[RoundCollector, Outcome, bool, SecureRoundRecord]:
        """A round under secure aggregation (coordinator/secure_rounds.py): the selected devices
        advertise keys and share secrets within their group (the round's devices, or each
        shard's), those that did train and upload masked vectors (to the coordinator, or to their
        shard's aggregator, which sums them still masked), the survivors of each group unmask its
        sum, and the algorithm folds each sum in as a partial sum. Returns the TRAIN's collector
        and outcome, whether the round aggregated, and how far each stage got."""
        from .secure_rounds import MIN_PARTICIPANTS

        self.algorithm.begin_round(round_)
        secure = self._secure_groups(round_, selected, eligible)
        self._share_keys(secure)
        shared = sorted(d for r in secure.rounds.values() for d in r.server.shared)
        log.info("round %d: %d of %d devices shared their keys; training", round_, len(shared), len(selected))
        if not secure.rounds:
            log.warning("round %d not trained: %s", round_, "; ".join(secure.failed))
            return (self._collector_for(round_, selected, quorum=len(selected)), Outcome.DEADLINE, False,
                    secure.record())
        self._deliver_shares(secure)
        task = Envelope(Kind.TRAIN, COORDINATOR, run_id=self.run_id, round=round_,
                        groups=self.algorithm.task_groups(round_),
                        config={"selected": shared, stages.SECURE: True, **self._task_config(round_, eligible)})
        # fewer masked vectors than MIN_PARTICIPANTS and their sum would tell each survivor the others'
        collector = self._collector_for(round_, shared, quorum=max(self.config.round.min_clients, MIN_PARTICIPANTS))

        def on_update(received: Received) -> None:
            envelope = received.envelope
            if self._admit(received, Kind.TRAIN_RES, round_, collector):
                try:
                    secure.rounds[0].on_masked(envelope.sender, envelope.groups)
                except ProtocolError as err:
                    self._refuse(envelope, collector, err.reason, err.detail)
                    return
                self._slowest_reply = max(self._slowest_reply or 0.0, self.clock() - started)
                collector.accept(envelope.sender, envelope.msg_id, self.clock())

        if secure.sharded:  # the masked vectors go to the shards' aggregators: their masked sums come here
            sharded = self.sharding.open(round_, shared, task.msg_id, collector, secure=secure.rounds)
            try:
                outcome = self._request(Kind.TRAIN, task, collector, self._misrouted_update)
                self.sharding.gather(sharded, self._windows()[1],
                                     lambda timeout: self._serve(timeout, self._stale_reply))
            finally:
                self.sharding.close()
            for shard, why in sorted(sharded.lost.items()):
                secure.drop(shard, why)
        else:
            outcome = self._request(Kind.TRAIN, task, collector, on_update)
        aggregated = collector.enough and self._unmask_and_fold(secure, collector)
        return collector, outcome, aggregated, secure.record()

    def _secure_groups(self, round_: int, selected: list[str], eligible: int) -> SecureGroups:
        """The round's secure groups: one of every selected device, or, sharded, one per shard whose
        aggregator is online (the devices of a shard without one sit the round out)."""
        from .secure_rounds import SecureGroups, SecureRound

        private = None
        if self.privacy is not None:  # distributed DP: the fixed-denominator mean of clipped, noised changes
            private = (self.privacy.share_bound(eligible), self.privacy.expected(eligible))
        shards = self.sharding.shards
        members: dict[int, list[str]] = {}
        for device in selected:
            members.setdefault(shard_of(device, shards) if shards else 0, []).append(device)
        online = set(self.registry.online(AGGREGATOR)) if shards else set()
        examples = {device: self.registry.devices[device].num_examples for device in selected}
        rounds, failed = {}, []
        for group, devices in sorted(members.items()):
            if shards and aggregator_id(group) not in online:
                failed.append((group, "its aggregator is offline"))
                continue
            try:
                rounds[group] = SecureRound(self.config.secagg, self.run_id, round_, devices,
                                            self.algorithm.update_spec(round_), {d: examples[d] for d in devices},
                                            private=private, largest=max(examples.values()))
            except SecAggError as exc:  # too few devices online for a sum that hides each of them
                failed.append((group, str(exc)))
        secure = SecureGroups(round_, rounds, len(selected), sharded=shards > 0)
        for group, why in failed:
            secure.drop(group, why)
            log.warning("round %d: %s", round_, secure.failed[-1])
        return secure

    def _share_keys(self, secure: SecureGroups) -> None:
        """The advertise and share stages; a group in which fewer than MIN_PARTICIPANTS devices
        shared their keys is dropped (its sum would tell each device the others')."""
        from .secure_rounds import MIN_PARTICIPANTS

        if secure.rounds:
            self._secure_stage(secure, stages.ADVERTISE, sorted(secure.group_of))
            advertised = sorted(d for r in secure.rounds.values() for d in r.server.advertised)
            self._secure_stage(secure, stages.SHARE, advertised)
        for group, part in sorted(secure.rounds.items()):
            if len(part.server.shared) < MIN_PARTICIPANTS:
                secure.drop(group, f"only {len(part.server.shared)} devices shared their keys; at least "
                                   f"{MIN_PARTICIPANTS} needed")

    def _deliver_shares(self, secure: SecureGroups) -> None:
        """The `shares` delivery: each device that shared keys gets the ciphertexts addressed to it."""
        for device, delivery in secure.deliveries().items():
            self.outbox.send(self.topics.down(device, Kind.SECAGG),
                             Envelope(Kind.SECAGG, COORDINATOR, run_id=self.run_id, round=secure.round,
                                      config={stages.STAGE: stages.SHARES, "selected": [device], **delivery}))

    def _unmask(self, secure: SecureGroups, lose: Callable[[str], object]) -> bool:
        """The confirm stage for the devices whose masked vector arrived (or was summed by their
        shard's aggregator), then the unmask stage for those that signed the survivor set; each
        group whose sum cannot be unmasked is dropped, its survivors passed to `lose`. False when
        no group is left."""
        survivors = sorted(d for r in secure.rounds.values() for d in r.server.survivors)
        if survivors:
            self._secure_stage(secure, stages.CONFIRM, survivors)
            signers = sorted(d for r in secure.rounds.values() for d in r.server.signers)
            if signers:
                self._secure_stage(secure, stages.UNMASK, signers)
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

    def _unmask_and_fold(self, secure: SecureGroups, collector: RoundCollector) -> bool:
        """The unmask stage, then each group's sum folded in as a partial sum and the round's
        state made; False (nothing aggregated) when no group can be unmasked. The devices of a
        group that cannot be unmasked count as missing."""
        round_ = secure.round
        if not self._unmask(secure, collector.lose):
            log.warning("round %d: nothing aggregated, global state unchanged", round_)
            return False
        summed = sum(len(part.server.survivors) for part in secure.rounds.values())
        if self.privacy is not None:
            self.privacy.note_secure_sum(summed)
        aggregating = self.clock()
        for part in secure.rounds.values():  # under distributed DP the shares of the denominator add up to 1
            self.algorithm.fold_partial(round_, part.partial(share=len(part.server.survivors) / summed))
        self.algorithm.close_round(round_)
        self.events.emit(RoundAggregated(round_, summed, self.clock() - aggregating))
        return True

    def _secure_stage(self, secure: SecureGroups, stage: str, devices: Iterable[str]) -> None:
        """Broadcast one SECAGG stage to `devices` and take their SECAGG_RES (each group's
        `SecureRound` keeps those it took) until each answered, went offline or the round's
        timeout passed. A device refusing the stage as inconsistent is counted under its reason."""
        from .secure_rounds import DeviceRefusal

        expected = sorted(devices)
        round_ = secure.round
        request = Envelope(Kind.SECAGG, COORDINATOR, run_id=self.run_id, round=round_,
                           config={stages.STAGE: stage, "selected": expected, **secure.config(stage)})
        collector = self._collector_for(round_, expected, quorum=len(expected))

        def on_reply(received: Received) -> None:
            envelope = received.envelope
            if self._admit(received, Kind.SECAGG_RES, round_, collector):
                try:
                    secure.on_reply(stage, envelope.sender, envelope.config)
                except DeviceRefusal as refusal:  # the device said why: counted, not NACKed
                    self.channel.reject(refusal.reason, f"SECAGG_RES refusing {refusal.detail}")
                    collector.refuse(envelope.sender, envelope.msg_id)
                    self._refusals[envelope.sender] = refusal.reason.value
                    return
                except ProtocolError as err:
                    self._refuse(envelope, collector, err.reason, err.detail)
                    return
                collector.accept(envelope.sender, envelope.msg_id, self.clock())

        self._request(Kind.SECAGG, request, collector, on_reply)

    def _collector_for(self, round_: int, devices: Iterable[str], *, quorum: int) -> RoundCollector:
        """A collector of `devices`' replies with the round's windows, waiting for `quorum` of them."""
        grace, timeout = self._windows()
        chosen = frozenset(devices)
        return RoundCollector(round_, chosen, min_replies=max(1, min(quorum, len(chosen))),
                              deadline=self.clock() + timeout, grace=grace)

    def _misrouted_update(self, received: Received) -> None:
        """An update sent to the coordinator in a sharded run (it goes to the device's shard)."""
        envelope = received.envelope
        if self._collector is not None and self._admit(received, Kind.TRAIN_RES, envelope.round, self._collector):
            self._refuse(envelope, self._collector, Reason.BAD_TOPIC,
                         f"update from {envelope.sender} sent to the coordinator; this run is sharded (shard "
                         f"{shard_of(envelope.sender, self.sharding.shards)})")

    def _on_update(self, received: Received, round_: int, sent: dict, collector: RoundCollector,
                   started: float) -> None:
        envelope = received.envelope
        if self.privacy is not None and envelope.kind is Kind.TRAIN_RES and envelope.round == round_:
            self.privacy.note_upload(envelope.sender, envelope.msg_id)  # refused or not, it went up
        if not self._admit(received, Kind.TRAIN_RES, round_, collector):
            return
        registered = self.registry.devices[envelope.sender].num_examples
        validating = self.clock()
        try:
            groups, weight = checked_update(self.algorithm, round_, envelope, sent, registered, self.limits,
                                            self.config.training.upload_codec)
            if self.privacy is not None:
                self.privacy.note_update(envelope.metrics)
        except ProtocolError as err:
            self._refuse(envelope, collector, err.reason, f"update from {envelope.sender}: {err.detail}")
            return
        accumulating = self.clock()
        self.algorithm.accumulate(envelope.sender, groups, envelope.metrics, weight)
        accepted = self.clock()
        collector.accept(envelope.sender, envelope.msg_id, accepted)
        self._slowest_reply = max(self._slowest_reply or 0.0, accepted - started)
        self.events.emit(UpdateAccepted(round_, envelope.sender, received.size, accepted - started,
                                        accumulating - validating, accepted - accumulating))

    # -- evaluation ------------------------------------------------------------------------
    def _releasable(self, what: str) -> bool:
        """Whether an evaluation outside a round (`what`) may release its figures: always without
        DP; under DP only within the budget. One that would exceed it is still played (the
        devices fit and deploy their heads) but its devices send no figures, and it is named in
        the log, the event log and metrics.jsonl (`evaluation_withheld`)."""
        if self.privacy is None:
            return True
        try:
            self.privacy.check_evaluation(what)
        except BudgetSpent as spent:
            log.warning("%s releases no figures: %s", what, spent)
            self.privacy.released_accuracy = None  # the last mean released is not this evaluation's
            self.ledger.event("evaluation_withheld", round=self.completed, evaluation=what)
            self.metrics.append({"event": "evaluation_withheld", "round": self.completed, "evaluation": what,
                                 "reason": str(spent), "privacy": self.privacy.record()})
            return False
        return True

    def _evaluate(self, round_: int, *, targets: list[str] | None = None, phase: str = "round",
                  pool: Pool | None = None, secure: SecureRound | None = None,
                  extra_groups: dict[str, ArrayGroup] | None = None, figures: bool = True) -> dict[str, dict[str, Any]]:
        """Devices evaluate the model they would deploy on their own test split: the trainers,
        and the weak devices once a representation is released. With a `pool` (a release
        phase), what the devices send in the pool's group is checked and pooled into it; with
        `secure` too, each device's share is a masked vector that `secure` takes instead.
        Without `figures` the devices answer with none (an evaluation the DP budget cannot
        release): nothing is released or accounted."""
        if targets is None:
            targets = self.registry.online() if self.release else self.registry.online("trainer")
        if not targets:
            return {}
        self._status("evaluating")
        request = Envelope(Kind.EVALUATE, COORDINATOR, run_id=self.run_id, round=round_,
                           groups={**self.algorithm.eval_groups(), **(extra_groups or {})},
                           config={"selected": targets, "final": round_ >= self.config.training.rounds, "phase": phase,
                                   **({stages.SECURE: True} if secure is not None else {}),
                                   **({} if figures else {FIGURES: False})})
        collector = RoundCollector(round_, frozenset(targets), min_replies=len(targets),
                                   deadline=self.clock() + self._windows()[1], grace=0.0)
        results: dict[str, dict[str, Any]] = {}
        private = self.privacy is not None and self.privacy.releases_evaluations
        evaluates = figures and (pool is None or pool.evaluates)
        released: list[float] = []  # private evaluation: the accuracies released only as a noised mean

        def on_result(received: Received) -> None:
            envelope = received.envelope
            if not self._admit(received, Kind.EVAL_RES, round_, collector):
                return
            examples = self.registry.devices[envelope.sender].num_examples
            result: dict[str, Any] = {"kind": self.registry.kind_of(envelope.sender)}
            if evaluates:
                accuracy = envelope.metrics.get("accuracy")
                if not self._plausible_accuracy(accuracy):
                    self._refuse(envelope, collector, Reason.MALFORMED,
                                 f"evaluation from {envelope.sender}: accuracy {accuracy!r}")
                    return
                holdout = envelope.sender in self.holdout
                if private:
                    if not holdout and accuracy is not None:
                        released.append(float(accuracy))
                    result.update(holdout=holdout, accuracy=None)
                else:
                    result.update(holdout=holdout, **envelope.metrics)
            elif not figures:  # withheld under DP: the device deployed what it would, and said nothing
                result.update(holdout=envelope.sender in self.holdout, accuracy=None)
            if pool is not None and secure is not None and (pool.required or stages.SECURE in envelope.groups):
                try:
                    secure.on_masked(envelope.sender, envelope.groups)
                except ProtocolError as err:
                    self._refuse(envelope, collector, err.reason, f"{pool.group} from {envelope.sender}: {err.detail}")
                    return
            elif pool is not None and (pool.required or pool.group in envelope.groups):
                try:
                    pool.check(envelope.groups.get(pool.group, {}), examples)
                except ProtocolError as err:
                    self._refuse(envelope, collector, err.reason, f"{pool.group} from {envelope.sender}: {err.detail}")
                    return
                pool.add(envelope.groups[pool.group], examples)
            results[envelope.sender] = result
            collector.accept(envelope.sender, envelope.msg_id, self.clock())

        self._request(Kind.EVALUATE, request, collector, on_result)
        self._stop_if_every_device_refused("evaluate", round_, targets, results)
        if private and evaluates and self.privacy is not None:
            self.privacy.release_accuracy(released, round_)
        missing = set(targets) - set(results)
        if missing:
            log.warning("round %d evaluation: no result from %s", round_, ", ".join(sorted(missing)))
        return results

    def _plausible_accuracy(self, accuracy: Any) -> bool:
        """An accuracy in [0, 1]; under local or distributed DP with private evaluation any finite
        number (each device added its own noise)."""
        if not isinstance(accuracy, (int, float)) or isinstance(accuracy, bool) or not math.isfinite(accuracy):
            return False
        noised = (self.privacy is not None and self.privacy.devices_noise_evaluations
                  and self.privacy.releases_evaluations)
        return noised or 0.0 <= accuracy <= 1.0

    def _accuracy(self, evaluation: dict[str, dict[str, Any]]) -> dict[str, float] | None:
        """The personalized accuracy of the devices not held out: summarized, or (private DP
        evaluation) the noised mean the evaluation released, and how many it is over."""
        if self.privacy is not None and self.privacy.releases_evaluations:
            mean = self.privacy.released_accuracy
            count = sum(1 for m in evaluation.values() if not m.get("holdout"))
            return None if mean is None else {"mean": mean, "count": count}
        return summarize(m["accuracy"] for m in evaluation.values() if not m.get("holdout"))

    # -- after training: the released representation --------------------------------------
    def _publish_release(self, release: Release) -> None:
        """The retained manifest: devices that join (or reconnect) later still see it."""
        manifest = Envelope(Kind.RELEASE, COORDINATOR, run_id=self.run_id, round=self.completed,
                            config=release.manifest())
        self.outbox.send(self.topics.broadcast(Kind.RELEASE), manifest, retain=True)

    def _release_phase(self) -> None:
        """Export and publish the representation (`ReleasePhase` pools what it needs); then
        evaluate the whole fleet, weak devices included, sending the pooled prototypes along."""
        phase = ReleasePhase(self.folder, self.algorithm.context.task.num_classes, self._gather,
                             state=self.algorithm.state, config=self._record(), model=self.model,
                             run_id=self.run_id, round_=self.completed)
        phase.pool_body_statistics(self.registry.online("trainer"))
        release = self.release = self._kept(phase.export())
        self._publish_release(release)
        self.ledger.event("released", round=self.completed, sha256=release.sha256, size=len(release.data))
        self.metrics.append({"event": "release", "round": self.completed, "sha256": release.sha256,
                             "bytes": len(release.data), "path": str(release.path)})
        # under DP the weak devices' class prototypes stay home: no mechanism covers them (under
        # secure aggregation they are summed masked, `_gather`)
        extra = phase.prototypes(self.registry.online("lite"), release) if self.privacy is None else {}
        final = self.ledger.final = self._evaluate(self.completed, phase="final", extra_groups=extra,
                                                   figures=self._releasable("the release's evaluation"))
        self._checkpoint()
        summary = self._accuracy(final)
        keep_release_results(self.folder.path, release, final)
        self.metrics.append({"event": "final_evaluation", "round": self.completed, "personalized_accuracy": summary,
                             "devices": len(final), "of_devices": self.registration.device_count()})

    def _kept(self, release: Release) -> Release:
        """`release` kept as the next of the run's numbered releases (`releases/<n>/`)."""
        kept = ReleaseStore(self.folder.path).add(release.data, release.metadata,
                                                  {"run_id": self.run_id, "round": self.completed}, None,
                                                  f"released by run {self.run_id} after round {self.completed}")
        return dataclasses.replace(release, version=kept.version)

    def _gather(self, targets: list[str], pool: Pool) -> None:
        """Ask `targets` for the pool's phase and pool their replies (their sum only, under
        secure aggregation)."""
        if self.config.secagg.secure_aggregation:
            self._secure_gather(targets, pool)
        else:
            self._evaluate(self.completed, targets=targets, phase=pool.phase, pool=pool)

    def _secure_gather(self, targets: list[str], pool: Pool) -> None:
        """A release pool under secure aggregation (edge_sdk/secagg/pools.py): the `targets`
        advertise keys and share them, answer the pool's EVALUATE with masked vectors of their
        shares, and the survivors unmask the sum, which the pool takes. With fewer than
        MIN_PARTICIPANTS devices, or too few shares to unmask, nothing is pooled (logged, and
        recorded in metrics.jsonl as `secure_pool`)."""
        from .secure_rounds import SecureGroups, SecurePool, SecureRound

        round_ = self.completed
        examples = {device: self.registry.devices[device].num_examples for device in targets}
        largest = max(examples.values(), default=1)
        try:
            part = SecureRound(self.config.secagg, self.run_id, round_, targets, {}, examples, largest=largest,
                               pool=SecurePool(pool.phase, pool.secure_length(),
                                               self.config.secagg.secagg_release_bound))
        except SecAggError as exc:
            log.warning("the %s pool is not gathered: %s", pool.phase, exc)
            self.metrics.append({"event": "secure_pool", "pool": pool.phase, "selected": len(targets),
                                 "failed": str(exc)})
            return
        secure = SecureGroups(round_, {0: part}, len(targets), sharded=False)
        self._share_keys(secure)
        if secure.rounds:
            self._deliver_shares(secure)
            self._evaluate(round_, targets=sorted(part.server.shared), phase=pool.phase, pool=pool, secure=part)
            if self._unmask(secure, lambda device: None):
                pool.add_sum(part.pool_sum(), len(part.server.survivors), largest)
        record = secure.record()
        if record.failed:
            log.warning("the %s pool is not gathered: %s", pool.phase, record.failed)
        self.metrics.append({"event": "secure_pool", "pool": pool.phase, **asdict(record)})
