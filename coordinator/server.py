"""The coordinator: builds a run's collaborators, runs it, publishes STATUS and routes messages.

A run: register the fleet (`registration`: HELLO, WELCOME, the fleet before round 1) -> play
its rounds (a round player, coordinator/players/: synchronous, secure or asynchronous) ->
after each round (evaluate) -> checkpoint -> one metrics line saying who took part (selected,
aggregated, refused, late, missing) -> release the representation if asked
(`players.release_phase`) -> the report. There are no algorithm branches here; everything
algorithm-specific sits behind `ServerAlgorithm`. Killed and restarted with the same `--out`,
it resumes after the last checkpointed round and never applies or records a round twice
(`players.run_state`); a run that already played all its rounds is left as it is
(`finished_report`). After a broker reconnection it publishes its status and the outstanding
request again (devices answer a repeated request with their cached reply, so nothing is
trained or applied twice).

The rooms around the loop: `shards.coordinator_side` (with `shards` K > 0, the shard aggregators' rosters,
notes and partials), `run.records` (each round's record and the run's report) and `outbox` (what
is sent, and the refusals, answered with a NACK where the sender is registered).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from edge_sdk.channel import Channel, Received
from edge_sdk.config import ConfigError
from edge_sdk.downlink import STATE
from edge_sdk.models import ModelSpec
from edge_sdk.privacy.upstream import PRIVACY
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Reason, new_message_id
from edge_sdk.secagg import stages

from . import algorithms
from .aggregation.validation import UpdateLimits, check_upload_codec
from .algorithms.base import ServerContext
from .config.run_config import RunConfig
from .events import DeviceOffline, DeviceOnline, EventBus, RoundEnded, RunStarted
from .fleet.devices import DeviceRegistry
from .fleet.nacks import NackLimiter
from .fleet.outbox import Outbox, RunPosition
from .fleet.registration import Registration, RegistrationTimeout
from .players.asynchronous import AsynchronousSteps
from .players.base import RoundPlayer
from .players.context import RunContext
from .players.evaluation import Evaluation
from .players.exchange import Exchange
from .players.release_phase import ReleaseStage
from .players.round_loop import RoundLoop
from .players.run_state import RunState, resume, run_record
from .players.sync import SynchronousRounds
from .privacy.budget import BudgetSpent
from .privacy.none import NoPrivacy
from .privacy.policy import check_dp_sgd_run, private_run
from .releases.phase import Release
from .rounds.async_steps import check_async_run
from .rounds.collector import LateUpdates
from .rounds.downlink import check_downlink_run
from .run import warm_start
from .run.folder import RunFolder
from .run.ledger import Ledger
from .run.records import RoundRecord, finished_report, played_report, run_report
from .run.report_files import MetricsLog, write_report
from .shards.coordinator_side import ShardedRounds
from .shards.sharding import check_shardable

__all__ = ["Coordinator", "RegistrationTimeout", "RoundRecord", "finished_report"]

log = logging.getLogger(__name__)


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
        check_downlink_run(config)
        if config.secagg.secure_aggregation:  # cryptography loads with a secure run only
            from .rounds.secagg import check_secure_run

            check_secure_run(config, algorithm_cls)
        self.hyper = algorithms.hyperparameters(config.run.algorithm, config.hyper)
        context = ServerContext(self.model, config.task(), config.training.seed, config.training.rounds,
                                config.run.clients, config.aggregation)
        self.algorithm = algorithm_cls(self.hyper, context)
        if config.run.release and not self.algorithm.shares_body():
            raise ConfigError(f"release: {config.run.algorithm} keeps the body personal (all of it or some of its "
                              "layers or channels), there is no whole global representation to release")
        check_dp_sgd_run(config, self.model)
        self.privacy = private_run(config, self.algorithm, self.model, run_record(config))
        self.limits = UpdateLimits(config.round.max_examples, config.round.max_update_norm,
                                   weighted=self.privacy is None)
        self.incarnation = new_message_id()[:12]
        self.metrics = MetricsLog(self.folder.metrics)
        self.position = RunPosition(new_message_id()[:16])
        self._status_state = "registering"
        self._connections = getattr(channel.transport, "connections", 0)
        self.late = LateUpdates(config.round.late_updates)
        self.nacks = NackLimiter(clock)
        history = resume(config, self.folder, self.position, self.algorithm, self.privacy, self.metrics)
        self.algorithm.state, self.init_from = warm_start.apply(config.run.init_from, self.algorithm.state,
                                                                history)
        """What a run with `init_from` started from (`WarmStart.record`); None for a cold start."""
        self.ledger = Ledger(channel, history)
        self.run_state = RunState(config, self.folder, self.position, self.algorithm, self.privacy, self.ledger,
                              self.init_from)
        self.outbox = Outbox(channel, self.registry, self.ledger, self.position, self.nacks)
        self.registration = Registration(config, self.algorithm, self.hyper, self.model, self.limits, self.registry,
                                         self.outbox, self.ledger, self.incarnation, privacy=self._announced_privacy(),
                                         data_private=self.privacy is not None)
        self.sharding = ShardedRounds(config.round.shards, self.algorithm, self.limits, self.registry, self.outbox,
                                      self.ledger, clock)
        self.run_context = RunContext(
            config, channel, clock, self.events, self.folder, self.model, self.algorithm,
            self.privacy if self.privacy is not None else NoPrivacy(config.round.fraction, config.training.seed),
            self.limits, self.registry, self.position, self.metrics, self.ledger, self.outbox, self.sharding,
            self.late, self._serve, self._status)
        self.exchange = Exchange(self.run_context)
        self.player = self._player()
        self.evaluation = Evaluation(self.run_context, self.exchange)
        self.rounds = RoundLoop(self.run_context, self.exchange, self.player, self.evaluation, self.run_state)
        self.release_stage = ReleaseStage(self.run_context, self.exchange, self.evaluation, self.run_state,
                                          self.registration.device_count)
        for client_id in self.expected_devices:  # before any HELLO: assignments in their order
            self.algorithm.assignment(client_id)

    def _player(self) -> RoundPlayer:
        """Who plays the rounds: asynchronous steps, secure rounds or synchronous rounds."""
        if self.config.round.mode == "async":
            return AsynchronousSteps(self.run_context, self.exchange)
        if self.config.secagg.secure_aggregation:
            from .players.secure import SecureRounds  # cryptography loads with a secure run only

            return SecureRounds(self.run_context, self.exchange)
        return SynchronousRounds(self.run_context, self.exchange)

    @property
    def run_id(self) -> str:
        return self.run_context.run_id

    @property
    def completed(self) -> int:
        """Rounds completed and checkpointed (`RunContext.completed`)."""
        return self.run_context.completed

    @property
    def holdout(self) -> frozenset[str]:
        """The devices held out of training (they evaluate only)."""
        return self.run_context.holdout

    @property
    def release(self) -> Release | None:
        """The representation released after training (None before, or without a release)."""
        return self.release_stage.release

    def subscribe(self, callback: Callable[[Any], None], *kinds: type) -> None:
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
        self.run_state.started = time.time()
        self.ledger.event("started", incarnation=self.incarnation, after_round=self.completed)
        self.channel.transport.subscribe(self.topics.all_up())
        self._status("registering")
        self.run_context.holdout = self.registration.await_fleet(self.run_context.serve_stale, self.clock,
                                                                 self.events)
        stopped = None
        for round_ in range(self.completed + 1, self.config.training.rounds + 1):
            try:
                self.rounds.play(round_)
            except BudgetSpent as spent:
                stopped = str(spent)
                log.warning("stopped before round %d: %s (a resume needs a larger --dp-epsilon)", round_, stopped)
                self.ledger.event("budget_spent", round=round_)
                self.metrics.append({"event": "budget_spent", "round": round_, "privacy": self.privacy.record()
                                     if self.privacy else None, "reason": stopped})
                break
        if stopped is None and not self.ledger.final and self.completed >= self.config.training.rounds:
            # resumed after the last round: its final evaluation is released only within the budget
            self.ledger.final = self.evaluation.evaluate(
                self.completed, figures=self.evaluation.releasable("the final evaluation"))
            self.run_state.checkpoint()  # with what its release added to the accountant
        if stopped is None and (self.config.run.release or self.algorithm.releases_representation):
            self.release_stage.play()
        report = run_report(self.config, self.hyper, run_id=self.run_id, completed=self.completed,
                            ledger=self.ledger, release=self.release, devices=self.registry.devices.values(),
                            devices_registered=self.registration.device_count(), partition=self.partition,
                            wall_seconds=self.run_state.wall_seconds(),
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
        elif envelope.kind is Kind.FETCH and STATE in envelope.config:
            self.exchange.serve_state(envelope)
        elif envelope.kind is Kind.FETCH:
            self.release_stage.serve_fetch(envelope)
        elif envelope.kind in (Kind.TRAIN_RES, Kind.EVAL_RES, Kind.SECAGG_RES):
            if envelope.run_id != self.run_id:
                self.exchange.reject_reply(envelope, Reason.WRONG_RUN,
                                           f"{envelope.kind.value} from {envelope.sender}: run {envelope.run_id!r}")
            elif envelope.sender not in self.registry.devices:
                self.outbox.reject(envelope, Reason.UNKNOWN_DEVICE, f"{envelope.sender} never registered")
            elif envelope.kind is not Kind.TRAIN_RES or not self.player.takes(received):
                on_reply(received)
        elif envelope.kind in (Kind.NOTE, Kind.PARTIAL):
            self.sharding.on_message(envelope)

    def _hello(self, hello: Envelope) -> None:
        """Register the sender (`Registration.on_hello`); a registration refreshes its Device.
        A device the open request still waits for gets that request again on its own topic: it
        says HELLO after a reconnection, and a broadcast published while it was away is lost (a
        shard aggregator gets its shard's part of the open round again, `ShardedRounds.rejoined`)."""
        before = self.registry.devices.get(hello.sender)
        self.registration.on_hello(hello)
        after = self.registry.devices.get(hello.sender)
        if after is not None and after is not before:
            self.events.emit(DeviceOnline(hello.sender, after.kind, len(self.registry.online()),
                                          self.registration.device_count()))
            self.sharding.rejoined(hello.sender)
            if not self.exchange.on_hello(hello.sender):
                self.player.on_hello(hello.sender)

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
            self.release_stage.publish(self.release)
        self.exchange.send_again()

    def _offline(self, client_id: str) -> None:
        device = self.registry.devices.get(client_id)
        was_online = device is not None and device.online
        self.registration.went_offline(client_id)
        if was_online:
            self.events.emit(DeviceOffline(client_id, len(self.registry.online())))
        self.exchange.on_offline(client_id)
        self.player.on_offline(client_id)
        self.sharding.aggregator_offline(client_id)
