"""The coordinator: wires the round state machine, an algorithm, the channel and checkpoints.

One round: select devices (seeded) -> broadcast TRAIN once -> collect validated replies until
all / quorum+grace / deadline (both grow with the reply times measured, `rounds.round_windows`)
-> aggregate (with the previous round's late updates under `late_updates = "next_round"`) ->
(evaluate) -> checkpoint -> one metrics line saying who took part (selected, aggregated, refused,
late, missing). There are no algorithm branches here; everything algorithm-specific sits behind
`ServerAlgorithm`. Killed and restarted with the same `--out`, it resumes after the last
checkpointed round and never applies or records a round twice; a run that already played all
its rounds is left as it is (`finished_report`). With `shards` K > 0, K shard aggregators
register too and sum their shards' updates; the coordinator adds their partials up
(`coordinator.sharding`). After a broker reconnection it
publishes its status and the outstanding request again (devices answer a repeated request with
their cached reply, so nothing is trained or applied twice).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from edge_sdk.channel import Channel, Received
from edge_sdk.config import ConfigError, to_plain
from edge_sdk.models import (ModelSpec, Signature, build_model, first_mismatch, model_signature, signature_from_plain,
                             signature_to_plain)
from edge_sdk.protocol import (COORDINATOR, ArrayGroup, Envelope, Kind, ProtocolError, Reason, aggregator_id,
                               check_client_id, new_message_id, shard_of_aggregator)

from . import algorithms, checkpoint
from .algorithms.base import ServerContext
from .config import RunConfig
from .devices import DeviceRegistry
from .events import (DevicesRegistered, Event, EventBus, RegistrationOpened, RoundAggregated, RoundEnded,
                     RoundEvaluated, RoundStarted, RunStarted, UpdateAccepted)
from .ledger import Ledger
from .release import Pool, Release, ReleasePhase
from .report import MetricsLog, read_report, summarize, write_report
from .rounds import LateUpdates, Outcome, RoundCollector, round_windows, select_clients
from .run_folder import RunFolder
from .sharding import AGGREGATOR, ShardRound, check_partial, check_shardable, shard_of
from .validation import UpdateLimits, checked_update

log = logging.getLogger(__name__)


class RegistrationTimeout(RuntimeError):
    """Too few devices registered before the registration timeout."""


def finished_report(config: RunConfig) -> dict[str, Any] | None:
    """The report of the run in `config.run.out` if that run already played `config.training.rounds`
    rounds and wrote its report (a rerun then changes nothing), else None. A checkpoint of a run
    with other settings raises `CheckpointError`."""
    folder = RunFolder(config.run.out)
    saved = checkpoint.load(folder.checkpoint)
    if saved is None:
        return None
    if saved.fingerprint != config.fingerprint():
        raise checkpoint.CheckpointError(
            f"{folder.path} holds run {saved.run_id} with other settings; use another --out to start a new run")
    return _finished(folder, saved.run_id, saved.round, config.training.rounds)


def _finished(folder: RunFolder, run_id: str, completed: int, rounds: int) -> dict[str, Any] | None:
    """The report of run `run_id` if it played all `rounds` (`completed` of them checkpointed)."""
    if completed < rounds:
        return None
    report = read_report(folder)
    if report is None or report.get("run_id") != run_id or report.get("rounds_completed") != completed:
        return None
    return report


@dataclass
class RoundRecord:
    """A round's line in metrics.jsonl: who took part, what it reached, what it cost."""

    round: int
    selected: int
    participants: int
    """Fresh updates aggregated (0 when the round is below its quorum: nothing is aggregated)."""
    outcome: str
    personalized_accuracy: dict | None
    global_accuracy: float | None
    bytes_up: int
    bytes_down: int
    """Published by the coordinator (a broadcast counts once)."""
    seconds: float
    rejections: dict[str, int] = field(default_factory=dict)
    replied: int = 0
    """Valid updates received in time (more than `participants` in a round below its quorum)."""
    refused: int = 0
    """Selected devices whose update was rejected."""
    late: int = 0
    """Selected devices still training, online, when the round closed."""
    missing: int = 0
    """Selected devices that went offline before replying."""
    late_folded: int = 0
    """Late updates of the previous round aggregated into this one (`late_updates = "next_round"`)."""
    late_discarded: int = 0
    """Late updates that arrived during this round and were dropped."""
    bytes_down_delivered: int = 0
    """What the broker delivered: each broadcast once per online registered device."""
    lost_shards: list[int] = field(default_factory=list)
    """Shards (`shards` > 0) whose partial was not aggregated: aggregator gone, partial refused or late."""
    lost_updates: int = 0
    """Updates a lost shard's aggregator had folded: checked, but not aggregated."""


class Coordinator:
    """Runs one federated training over a `Channel`; `run()` returns the report. Observers
    `subscribe` to its events (coordinator/events.py); `on_round` receives each round's record.

    `expected_devices` names devices the run expects (a simulation's: dev000, dev001, ...): what
    the algorithm hands out in order of registration (FediOS's projection blocks, DC-PFL's body
    models) is handed out to them in that order before registration opens, so it does not depend
    on the order their HELLOs arrive in (devices on several hosts). Not the ROSTER message, which
    tells a shard aggregator a round's devices."""

    def __init__(
        self,
        config: RunConfig,
        channel: Channel,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        model: ModelSpec | None = None,
        expected_devices: Sequence[str] = (),
    ):
        self.config = config
        self.expected_devices = tuple(expected_devices)
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
        self.shards = config.round.shards
        check_shardable(algorithm_cls, config.aggregation.rule, self.shards)
        self._sharded: ShardRound | None = None  # the training round's shards, while it is open
        self.hyper = algorithms.hyperparameters(config.run.algorithm, config.hyper)
        context = ServerContext(self.model, config.task(), config.training.seed, config.training.rounds,
                                config.run.clients, config.aggregation)
        self.algorithm = algorithm_cls(self.hyper, context)
        if config.run.release and not self.algorithm.shares_body():
            raise ConfigError(f"release: {config.run.algorithm} keeps the body personal, there is no global "
                              "representation to release")
        self.limits = UpdateLimits(config.round.max_examples, config.round.max_update_norm)
        self.incarnation = new_message_id()[:12]
        self.metrics = MetricsLog(self.folder.metrics)
        self.run_id = new_message_id()[:16]
        self.completed = 0
        self.holdout: frozenset[str] = frozenset()
        self._collector: RoundCollector | None = None
        self._outstanding: tuple[str, Envelope] | None = None  # the request being collected
        self._status_state = "registering"
        self._connections = getattr(channel.transport, "connections", 0)
        self.release: Release | None = None
        self._model_signature: Signature | None = None
        self.late = LateUpdates(config.round.late_updates)
        self._slowest_reply: float | None = None  # seconds from a round's start to an accepted update
        self._started = time.time()
        self.ledger = Ledger(channel, self._resume())
        for client_id in self.expected_devices:  # before any HELLO: assignments in their order
            self.algorithm.assignment(client_id)

    def subscribe(self, callback: Callable[[Event], None], *kinds: type) -> None:
        """Call `callback(event)` for each event of the given types (every event without any)."""
        self.events.subscribe(callback, *kinds)

    # -- checkpoints -----------------------------------------------------------------------
    def _resume(self) -> dict[str, Any] | None:
        saved = checkpoint.load(self.folder.checkpoint)
        if saved is None:
            return None
        if saved.fingerprint != self.config.fingerprint():
            raise checkpoint.CheckpointError(
                f"{self.folder.path} holds run {saved.run_id} with other settings; use another --out to start a new run"
            )
        self.run_id, self.completed = saved.run_id, saved.round
        self.algorithm.state = saved.state
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
        checkpoint.save(
            self.folder.checkpoint,
            checkpoint.Checkpoint(self.run_id, self.completed, self.config.fingerprint(), self.algorithm.state, history),
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
        done = _finished(self.folder, self.run_id, self.completed, rounds)
        if done is not None:
            log.info("run %s already finished all %d rounds; nothing changed", self.run_id, rounds)
            return done
        self._started = time.time()
        self.ledger.event("started", incarnation=self.incarnation, after_round=self.completed)
        self.channel.transport.subscribe(self.topics.all_up())
        self._status("registering")
        self._await_devices()
        for round_ in range(self.completed + 1, self.config.training.rounds + 1):
            self._play_round(round_)
        if not self.ledger.final and self.completed >= self.config.training.rounds:
            self.ledger.final = self._evaluate(self.completed)  # resumed after the last round
        if self.config.run.release or self.algorithm.releases_representation:
            self._release_phase()
        report = self._report(self._wall_seconds())
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
        envelope = Envelope(Kind.STATUS, COORDINATOR, run_id=self.run_id, round=self.completed, config=config)
        self._send(self.topics.broadcast(Kind.STATUS), envelope, retain=True)

    def _send(self, topic: str, envelope: Envelope, *, retain: bool = False) -> None:
        """Publish, counting what the broker delivers: a broadcast reaches every online
        registered device (devices subscribe to every broadcast kind), a device's own topic one."""
        before = self.channel.counter.snapshot()[0]
        self.channel.send(topic, envelope, retain=retain)
        published = self.channel.counter.snapshot()[0] - before
        broadcast = topic == self.topics.broadcast(envelope.kind)
        self.ledger.count_delivered(envelope.kind.value, published * (len(self.registry.online()) if broadcast else 1))

    def _await_devices(self) -> None:
        opened = self.clock()
        self.events.emit(RegistrationOpened(self.config.run.clients))
        deadline = opened + self.config.round.registration_timeout
        while ((len(self.registry.online()) < self.config.run.clients or self._aggregators_missing())
               and self.clock() < deadline):
            self._serve(min(1.0, deadline - self.clock()), on_reply=self._stale_reply)
        missing = self._aggregators_missing()
        if missing:
            raise RegistrationTimeout(
                f"shard aggregators {', '.join(map(aggregator_id, missing))} did not register within "
                f"{self.config.round.registration_timeout:.0f} s; start `edgepfl aggregator --shard k/{self.shards}` "
                "for each")
        have = len(self.registry.online("trainer"))
        if have < self.config.round.min_clients:
            raise RegistrationTimeout(
                f"only {have} trainer devices registered within {self.config.round.registration_timeout:.0f} s; "
                f"--min-clients is {self.config.round.min_clients}"
            )
        if self.config.round.holdout_clients:
            self.holdout = frozenset(self.registry.online("trainer")[-self.config.round.holdout_clients:])
            log.info("held out of training (heads only): %s", ", ".join(sorted(self.holdout)))
        devices = self._device_count()
        log.info("%d devices registered (%d trainers)%s; starting", devices, have,
                 f" and {self.shards} shard aggregators" if self.shards else "")
        self.events.emit(DevicesRegistered(devices, have, self.clock() - opened))

    def _device_count(self) -> int:
        """Registered devices (trainers and weak ones; shard aggregators are not devices)."""
        return sum(1 for device in self.registry.devices.values() if device.kind != AGGREGATOR)

    def _aggregators_missing(self) -> list[int]:
        """Shards whose aggregator is not online."""
        online = set(self.registry.online(AGGREGATOR))
        return [k for k in range(self.shards) if aggregator_id(k) not in online]

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
            self._register(envelope)
        elif envelope.kind is Kind.OFFLINE:
            self._offline(envelope.sender)
        elif envelope.kind is Kind.FETCH:
            self._serve_fetch(envelope)
        elif envelope.kind in (Kind.TRAIN_RES, Kind.EVAL_RES):
            if envelope.run_id != self.run_id:
                self.channel.reject(Reason.WRONG_RUN, f"{envelope.sender}: run {envelope.run_id!r}")
            elif envelope.sender not in self.registry.devices:
                self.channel.reject(Reason.UNKNOWN_DEVICE, f"{envelope.sender} never registered")
            elif envelope.kind is Kind.TRAIN_RES and self.late.expects(envelope.sender, envelope.round,
                                                                      envelope.config.get("in_reply_to")):
                self._late_update(envelope)
            else:
                on_reply(received)
        elif envelope.kind in (Kind.NOTE, Kind.PARTIAL):
            if envelope.run_id != self.run_id:
                self.channel.reject(Reason.WRONG_RUN, f"{envelope.kind.value} from {envelope.sender}: run "
                                                      f"{envelope.run_id!r}")
            elif self.registry.kind_of(envelope.sender) != AGGREGATOR:
                self.channel.reject(Reason.UNKNOWN_DEVICE, f"{envelope.kind.value} from {envelope.sender}, not a "
                                                           "registered shard aggregator")
            elif self._sharded is None:
                self._stale_reply(received)
            else:
                self._on_shard_message(envelope)

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
            self._publish_release()
        if self._outstanding is not None:
            self._send(*self._outstanding)

    def _serve_fetch(self, fetch: Envelope) -> None:
        """Send the released artifact to a registered device that asks for it by sha256."""
        wanted = fetch.config.get("sha256")
        if fetch.run_id != self.run_id:
            self.channel.reject(Reason.WRONG_RUN, f"FETCH from {fetch.sender} for run {fetch.run_id!r}")
        elif fetch.sender not in self.registry.devices:
            self.channel.reject(Reason.UNKNOWN_DEVICE, f"FETCH from {fetch.sender}, never registered")
        elif self.release is None or wanted != self.release.sha256:
            self.channel.reject(Reason.UNKNOWN_ARTIFACT, f"FETCH of {str(wanted)[:16]!r} from {fetch.sender}")
        else:
            artifact = Envelope(Kind.ARTIFACT, COORDINATOR, run_id=self.run_id, round=self.completed,
                                groups=self.release.artifact(), config={"sha256": self.release.sha256})
            self._send(self.topics.down(fetch.sender, Kind.ARTIFACT), artifact)

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
            self.channel.reject(err.reason, f"late update from {envelope.sender}: {err.detail}")
            return
        self.late.keep(envelope.sender, groups, envelope.metrics, weight)
        log.info("round %d: late update from %s kept for round %d", round_, envelope.sender, round_ + 1)

    def _stale_reply(self, received: Received) -> None:
        envelope = received.envelope
        self.channel.reject(Reason.STALE, f"{envelope.kind.value} from {envelope.sender} for round {envelope.round}")

    def _register(self, hello: Envelope) -> None:
        kind = hello.config.get("device_type", "trainer")
        examples = hello.metrics.get("num_examples", 0)
        try:
            check_client_id(hello.sender)
        except ValueError as exc:
            self.channel.reject(Reason.MALFORMED, f"HELLO: {exc}")
            return
        if kind == AGGREGATOR or shard_of_aggregator(hello.sender) is not None:
            self._register_aggregator(hello)
            return
        if (kind not in ("trainer", "lite") or not isinstance(examples, (int, float))
                or not math.isfinite(examples) or examples < 1):
            self.channel.reject(Reason.MALFORMED, f"HELLO from {hello.sender}: device_type {kind!r}, examples {examples!r}")
            return
        mismatch = self._model_mismatch(hello) if kind == "trainer" else None
        if mismatch is not None:
            self.channel.reject(Reason.MODEL_MISMATCH, f"HELLO from {hello.sender}: {mismatch}")
            refusal = Envelope(Kind.WELCOME, COORDINATOR, run_id=self.run_id, round=self.completed,
                               config={"refused": f"its model differs from the run's: {mismatch}"})
            self._send(self.topics.down(hello.sender, Kind.WELCOME), refusal)
            return
        known = hello.sender in self.registry.devices
        self.registry.register(hello.sender, kind, int(examples), hello.config)
        self.ledger.event("rejoined" if known else "registered", device=hello.sender, round=self.completed + 1)
        log.info("%s %s (%s, %d examples)", "re-registered" if known else "registered", hello.sender, kind, examples)
        self._send(self.topics.down(hello.sender, Kind.WELCOME), self.welcome(hello.sender))

    def _register_aggregator(self, hello: Envelope) -> None:
        """A shard aggregator: `aggregator-<k>` with device_type "aggregator", for one of this
        run's shards; it gets the run's aggregation settings, or a refusal that says why not."""
        shard, kind = shard_of_aggregator(hello.sender), hello.config.get("device_type")
        if kind != AGGREGATOR or hello.config.get("shard") != shard:
            self.channel.reject(Reason.MALFORMED, f"HELLO from {hello.sender}: ids aggregator-<k> are reserved for "
                                                  f"the aggregator of shard k (device_type {kind!r})")
            return
        if not self.shards or shard >= self.shards or hello.config.get("shards") != self.shards:
            refusal = (f"this run has shards {self.shards}; {hello.sender} came as shard {shard} of "
                       f"{hello.config.get('shards')!r}")
            self.channel.reject(Reason.MALFORMED, f"HELLO: {refusal}")
            self._send(self.topics.down(hello.sender, Kind.WELCOME),
                       Envelope(Kind.WELCOME, COORDINATOR, run_id=self.run_id, round=self.completed,
                                config={"refused": refusal}))
            return
        known = hello.sender in self.registry.devices
        self.registry.register(hello.sender, AGGREGATOR, 0, hello.config)
        self.ledger.event("rejoined" if known else "registered", device=hello.sender, round=self.completed + 1)
        log.info("%s shard aggregator %s", "re-registered" if known else "registered", hello.sender)
        self._send(self.topics.down(hello.sender, Kind.WELCOME), self.welcome(hello.sender))

    @property
    def model_signature(self) -> Signature:
        """Names and shapes of the run's plain model (body and head) for the run's task."""
        if self._model_signature is None:
            self._model_signature = model_signature(build_model(self.model, self.config.task()))
        return self._model_signature

    def _model_mismatch(self, hello: Envelope) -> str | None:
        """Why a device that brings a model of its own (HELLO `model`) cannot join: the first
        parameter where its model differs from the run's; None when it brings none or agrees."""
        described = hello.config.get("model")
        if described is None:
            return None
        try:
            signature = signature_from_plain(described.get("signature") if isinstance(described, dict) else None)
        except ValueError as exc:
            return str(exc)
        return first_mismatch(self.model_signature, signature)

    def welcome(self, client_id: str) -> Envelope:
        """The WELCOME a registered device receives: the run, the algorithm with its
        hyperparameters, the device's assignment and the training settings; under sharded
        aggregation a trainer's `shard`, and a shard aggregator what it checks and sums with."""
        if self.registry.kind_of(client_id) == AGGREGATOR:
            return Envelope(Kind.WELCOME, COORDINATOR, run_id=self.run_id, round=self.completed,
                            config={"incarnation": self.incarnation, "algorithm": self.config.run.algorithm,
                                    "hyper": to_plain(self.hyper), "aggregation": self._aggregation_settings()})
        config = {
            "incarnation": self.incarnation,
            "algorithm": self.config.run.algorithm,
            "hyper": to_plain(self.hyper),
            "assignment": self.algorithm.assignment(client_id),
            "settings": self.config.welcome_settings(),
            "model_signature": signature_to_plain(self.model_signature),
        }
        if self.shards and self.registry.kind_of(client_id) == "trainer":
            config["shard"] = shard_of(client_id, self.shards)
        return Envelope(Kind.WELCOME, COORDINATOR, run_id=self.run_id, round=self.completed, config=config)

    def _aggregation_settings(self) -> dict[str, Any]:
        """What a shard aggregator needs to check and sum updates as this coordinator would."""
        context = self.algorithm.context
        return {"model": self.config.model_name, "task": context.task.to_plain(), "seed": context.seed,
                "rounds": context.rounds, "clients": context.clients, "rule": asdict(context.aggregation),
                "max_examples": self.limits.max_examples, "max_update_norm": self.limits.max_update_norm,
                "upload_codec": self.config.training.upload_codec}

    def _offline(self, client_id: str) -> None:
        if client_id in self.registry.devices and self.registry.devices[client_id].online:
            log.info("%s went offline", client_id)
            self.ledger.event("offline", device=client_id, round=self.completed + 1)
        self.registry.mark_offline(client_id)
        if self._collector is not None:
            self._collector.mark_offline(client_id)
        shard = shard_of_aggregator(client_id)
        if self._sharded is not None and shard is not None:
            self._lose_shard(shard, "its aggregator went offline")

    def _request(self, kind: Kind, envelope: Envelope, collector: RoundCollector,
                 on_reply: Callable[[Received], None]) -> Outcome:
        """Broadcast a request and collect the replies until the collector says the round is over."""
        self._outstanding = (self.topics.broadcast(kind), envelope)
        self._collector = collector
        self._send(*self._outstanding)
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
            self.channel.reject(Reason.STALE, f"{envelope.kind.value} from {envelope.sender} for round {envelope.round}"
                                f" is not a reply to the open request")
            return False
        reason = collector.check(envelope.sender, envelope.msg_id)
        if reason is Reason.DUPLICATE:
            self.channel.count_duplicate()
            return False
        if reason is not None:
            self.channel.reject(reason, f"{envelope.kind.value} from {envelope.sender} in round {round_}")
            return False
        return True

    def _refuse(self, envelope: Envelope, collector: RoundCollector, reason: Reason, detail: str) -> None:
        """Reject a device's answer to the open request; it sends no other, so it is not waited for."""
        self.channel.reject(reason, detail)
        collector.refuse(envelope.sender, envelope.msg_id)

    # -- one round -------------------------------------------------------------------------
    def _play_round(self, round_: int) -> None:
        started, (sent0, received0) = self.clock(), self.channel.counter.snapshot()
        channel0 = self.channel.counters.snapshot()
        delivered0, discarded0 = self.ledger.delivered_total(), self.late.discarded
        candidates = [c for c in self.registry.online("trainer") if c not in self.holdout]
        selected = select_clients(candidates, self.config.round.fraction, self.config.training.seed, round_)
        self.events.emit(RoundStarted(round_, tuple(selected)))
        self._status("training")
        collector, outcome, folded, sharded = self._train(round_, selected, started)
        evaluation = None
        accuracies: list[float] = []
        if round_ % self.config.round.eval_every == 0 or round_ == self.config.training.rounds:
            evaluating = self.clock()
            evaluation = self.ledger.final = self._evaluate(round_)
            accuracies = [m["accuracy"] for cid, m in evaluation.items() if cid not in self.holdout]
            self.events.emit(RoundEvaluated(round_, len(evaluation), (summarize(accuracies) or {}).get("mean"),
                                            self.clock() - evaluating))
        sent1, received1 = self.channel.counter.snapshot()
        channel = self.channel.counters.snapshot() - channel0
        global_accuracies = [m["global_accuracy"] for m in (evaluation or {}).values() if "global_accuracy" in m]
        record = RoundRecord(
            round=round_,
            selected=len(selected),
            participants=len(collector.replied) if collector.enough else 0,
            outcome=outcome.value if collector.enough else "aborted",
            personalized_accuracy=summarize(accuracies),
            global_accuracy=(summarize(global_accuracies) or {}).get("mean"),
            bytes_up=received1 - received0,
            bytes_down=sent1 - sent0,
            seconds=self.clock() - started,
            rejections=channel.rejections,
            replied=len(collector.replied),
            refused=len(collector.refused),
            late=len(collector.waiting),
            missing=len(collector.offline),
            late_folded=folded,
            late_discarded=self.late.discarded - discarded0,
            bytes_down_delivered=self.ledger.delivered_total() - delivered0,
            lost_shards=sorted(sharded.lost) if sharded else [],
            lost_updates=sharded.lost_updates if sharded else 0,
        )
        entry = asdict(record)
        self.completed = round_
        self.ledger.rounds.append(entry)
        self._checkpoint()
        self.metrics.append({"event": "round", **entry})
        acc = (record.personalized_accuracy or {}).get("mean")
        log.info("round %d/%d: %s, %d of %d selected aggregated (%d late, %d missing, %d refused), accuracy %s, "
                 "%.2f MB, %.1f s", round_, self.config.training.rounds, record.outcome, record.participants,
                 record.selected, record.late, record.missing, record.refused,
                 f"{acc:.4f}" if acc is not None else "-", (record.bytes_up + record.bytes_down) / 1e6, record.seconds)
        self.events.emit(RoundEnded(round_, entry, channel))

    def _windows(self) -> tuple[float, float]:
        """(grace, timeout) of the next request, from the settings and the replies measured."""
        settings = self.config.round
        return round_windows(settings.quorum_grace, settings.round_timeout, settings.patience, self._slowest_reply)

    def _train(self, round_: int, selected: list[str],
               started: float) -> tuple[RoundCollector, Outcome, int, ShardRound | None]:
        """Broadcast TRAIN, fold the replies in (and the previous round's late updates kept for
        this one), aggregate; returns the collector, the outcome, how many late updates were
        folded and, sharded, the round's shards. What was broadcast is let go on return, before
        evaluation and the checkpoint (kept only while late updates may be folded against it)."""
        self.algorithm.begin_round(round_)
        groups = self.algorithm.task_groups(round_)
        task = Envelope(Kind.TRAIN, COORDINATOR, run_id=self.run_id, round=round_, groups=groups,
                        config={"selected": selected, **self.algorithm.task_config(round_)})
        grace, timeout = self._windows()
        collector = RoundCollector(
            round_,
            frozenset(selected),
            min_replies=max(1, min(self.config.round.min_clients, len(selected))),
            deadline=self.clock() + timeout,
            grace=grace,
        )
        if self.shards:
            self._sharded = self._open_shards(round_, selected, task.msg_id, collector)
            on_update = self._misrouted_update
        else:
            on_update = lambda r: self._on_update(r, round_, groups, collector, started)  # noqa: E731
        sharded = self._sharded
        try:
            outcome = self._request(Kind.TRAIN, task, collector, on_update)
            if sharded is not None:
                self._gather_partials(sharded)
        finally:
            self._sharded = None
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

    # -- sharded rounds --------------------------------------------------------------------
    def _open_shards(self, round_: int, selected: list[str], request_id: str,
                     collector: RoundCollector) -> ShardRound:
        """Send each shard's aggregator its ROSTER (before the TRAIN broadcast it belongs to); a
        shard whose aggregator is offline is lost from the start."""
        rosters: dict[int, dict[str, int]] = {}
        for client_id in selected:
            rosters.setdefault(shard_of(client_id, self.shards), {})[client_id] = \
                self.registry.devices[client_id].num_examples
        sharded = ShardRound(request_id, rosters, collector)
        online = set(self.registry.online(AGGREGATOR))
        for shard, roster in sorted(rosters.items()):
            if aggregator_id(shard) not in online:
                self._lose_shard(shard, "its aggregator is offline", sharded)
                continue
            self._send(self.topics.down(aggregator_id(shard), Kind.ROSTER),
                       Envelope(Kind.ROSTER, COORDINATOR, run_id=self.run_id, round=round_,
                                config={"request": request_id, "devices": roster}))
        return sharded

    def _misrouted_update(self, received: Received) -> None:
        """An update sent to the coordinator in a sharded run (it goes to the device's shard)."""
        envelope = received.envelope
        if self._collector is not None and self._admit(received, Kind.TRAIN_RES, envelope.round, self._collector):
            self._refuse(envelope, self._collector, Reason.BAD_TOPIC,
                         f"update from {envelope.sender} sent to the coordinator; this run is sharded (shard "
                         f"{shard_of(envelope.sender, self.shards)})")

    def _on_shard_message(self, envelope: Envelope) -> None:
        """A NOTE or PARTIAL of the open training round from a registered aggregator."""
        sharded, shard = self._sharded, shard_of_aggregator(envelope.sender)
        if envelope.config.get("in_reply_to") != sharded.request_id or shard not in sharded.open_shards:
            self.channel.reject(Reason.STALE, f"{envelope.kind.value} from {envelope.sender} for round "
                                              f"{envelope.round} is not expected (closed, lost or another round)")
        elif envelope.kind is Kind.NOTE:
            self._on_note(sharded, shard, envelope)
        else:
            self._on_partial(sharded, shard, envelope)

    def _on_note(self, sharded: ShardRound, shard: int, note: Envelope) -> None:
        """Updates shard `shard`'s aggregator folded or refused: the round's progress."""
        roster, now = sharded.rosters[shard], self.clock()
        accepted, refused = note.config.get("accepted", []), note.config.get("refused", [])
        if not isinstance(accepted, list) or not isinstance(refused, list):
            self.channel.reject(Reason.MALFORMED, f"NOTE from {note.sender}: accepted and refused must be lists")
            return
        for client_id in accepted:
            if client_id not in roster:
                self.channel.reject(Reason.NOT_SELECTED, f"NOTE from {note.sender}: {client_id!r} is not selected "
                                                         f"in shard {shard}")
            else:
                sharded.folded(shard, client_id, note.msg_id, now)
        for entry in refused:
            client_id, reason, detail = (list(entry) + ["", "", ""])[:3] if isinstance(entry, list) else ("", "", "")
            if client_id not in roster or client_id in sharded.collector.replied:
                self.channel.reject(Reason.NOT_SELECTED, f"NOTE from {note.sender}: refusal of {client_id!r}")
                continue
            code = Reason(reason) if reason in Reason._value2member_map_ else Reason.MALFORMED
            self._refuse(Envelope(Kind.TRAIN_RES, client_id, msg_id=f"{note.msg_id}/{client_id}"), sharded.collector,
                         code, f"update from {client_id} (shard {shard}): {detail}")

    def _on_partial(self, sharded: ShardRound, shard: int, partial: Envelope) -> None:
        """Check shard `shard`'s PARTIAL and fold it in; a refused one loses the shard's round."""
        round_ = sharded.collector.round
        try:
            checked = check_partial(partial, shard, sharded.rosters[shard], self.algorithm.partial_spec(round_),
                                    self.limits.max_examples)
        except ProtocolError as err:
            self.channel.reject(err.reason, f"PARTIAL from {partial.sender}: {err.detail}")
            self._lose_shard(shard, f"its partial was refused ({err.reason.value})")
            return
        if checked.folded:
            self.algorithm.fold_partial(round_, checked.sums)
        sharded.deliver(checked, partial.msg_id, self.clock())
        log.info("round %d: partial of shard %d folded (%d updates)", round_, shard, len(checked.folded))

    def _lose_shard(self, shard: int, why: str, sharded: ShardRound | None = None) -> None:
        """Shard `shard` delivers nothing this round (if it was still expected to), logged and recorded."""
        sharded = sharded or self._sharded
        if shard in sharded.open_shards:
            lost = sharded.lose(shard, why)
            log.warning("round %d: shard %d lost, %s: %d folded updates not aggregated", sharded.collector.round,
                        shard, why, lost)
            self.ledger.event("shard_lost", shard=shard, round=sharded.collector.round, updates=lost, why=why)

    def _gather_partials(self, sharded: ShardRound) -> None:
        """The round closed: ask the aggregators still summing for their PARTIAL and wait for
        them (up to the round's timeout window); a shard that does not deliver is lost."""
        for shard in sharded.open_shards:
            self._send(self.topics.down(aggregator_id(shard), Kind.CLOSE),
                       Envelope(Kind.CLOSE, COORDINATOR, run_id=self.run_id, round=sharded.collector.round,
                                config={"request": sharded.request_id}))
        deadline = self.clock() + self._windows()[1]
        while sharded.open_shards and self.clock() < deadline:
            self._serve(min(1.0, deadline - self.clock()), self._stale_reply)
        for shard in sharded.open_shards:
            self._lose_shard(shard, "no partial came before the timeout")

    def _on_update(self, received: Received, round_: int, sent: dict, collector: RoundCollector,
                   started: float) -> None:
        envelope = received.envelope
        if not self._admit(received, Kind.TRAIN_RES, round_, collector):
            return
        registered = self.registry.devices[envelope.sender].num_examples
        validating = self.clock()
        try:
            groups, weight = checked_update(self.algorithm, round_, envelope, sent, registered, self.limits,
                                            self.config.training.upload_codec)
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
    def _evaluate(self, round_: int, *, targets: list[str] | None = None, phase: str = "round",
                  pool: Pool | None = None,
                  extra_groups: dict[str, ArrayGroup] | None = None) -> dict[str, dict[str, Any]]:
        """Devices evaluate the model they would deploy on their own test split: the trainers,
        and the weak devices once a representation is released. With a `pool` (a release
        phase), what the devices send in the pool's group is checked and pooled into it."""
        if targets is None:
            targets = self.registry.online() if self.release else self.registry.online("trainer")
        if not targets:
            return {}
        self._status("evaluating")
        request = Envelope(Kind.EVALUATE, COORDINATOR, run_id=self.run_id, round=round_,
                           groups={**self.algorithm.eval_groups(), **(extra_groups or {})},
                           config={"selected": targets, "final": round_ >= self.config.training.rounds, "phase": phase})
        collector = RoundCollector(round_, frozenset(targets), min_replies=len(targets),
                                   deadline=self.clock() + self._windows()[1], grace=0.0)
        results: dict[str, dict[str, Any]] = {}

        def on_result(received: Received) -> None:
            envelope = received.envelope
            if not self._admit(received, Kind.EVAL_RES, round_, collector):
                return
            examples = self.registry.devices[envelope.sender].num_examples
            result: dict[str, Any] = {"kind": self.registry.kind_of(envelope.sender)}
            if pool is None or pool.evaluates:
                accuracy = envelope.metrics.get("accuracy")
                if not isinstance(accuracy, (int, float)) or not 0.0 <= accuracy <= 1.0:
                    self._refuse(envelope, collector, Reason.MALFORMED,
                                 f"evaluation from {envelope.sender}: accuracy {accuracy!r}")
                    return
                result.update(holdout=envelope.sender in self.holdout, **envelope.metrics)
            pooled = pool is not None and (pool.required or pool.group in envelope.groups)
            if pooled:
                try:
                    pool.check(envelope.groups.get(pool.group, {}), examples)
                except ProtocolError as err:
                    self._refuse(envelope, collector, err.reason, f"{pool.group} from {envelope.sender}: {err.detail}")
                    return
                pool.add(envelope.groups[pool.group], examples)
            results[envelope.sender] = result
            collector.accept(envelope.sender, envelope.msg_id, self.clock())

        self._request(Kind.EVALUATE, request, collector, on_result)
        missing = set(targets) - set(results)
        if missing:
            log.warning("round %d evaluation: no result from %s", round_, ", ".join(sorted(missing)))
        return results

    # -- after training: the released representation --------------------------------------
    def _publish_release(self) -> None:
        """The retained manifest: devices that join (or reconnect) later still see it."""
        manifest = Envelope(Kind.RELEASE, COORDINATOR, run_id=self.run_id, round=self.completed,
                            config=self.release.manifest())
        self._send(self.topics.broadcast(Kind.RELEASE), manifest, retain=True)

    def _release_phase(self) -> None:
        """Export and publish the representation (`ReleasePhase` pools what it needs); then
        evaluate the whole fleet, weak devices included, sending the pooled prototypes along."""
        phase = ReleasePhase(self.folder, self.algorithm.context.task.num_classes, self._gather,
                             state=self.algorithm.state, config=self._record(), model=self.model,
                             run_id=self.run_id, round_=self.completed)
        phase.pool_body_statistics(self.registry.online("trainer"))
        self.release = phase.export()
        self._publish_release()
        self.ledger.event("released", round=self.completed, sha256=self.release.sha256, size=len(self.release.data))
        self.metrics.append({"event": "release", "round": self.completed, "sha256": self.release.sha256,
                             "bytes": len(self.release.data), "path": str(self.release.path)})
        extra = phase.prototypes(self.registry.online("lite"), self.release)
        self.ledger.final = self._evaluate(self.completed, phase="final", extra_groups=extra)
        self._checkpoint()
        summary = summarize(m["accuracy"] for m in self.ledger.final.values() if not m.get("holdout"))
        self.metrics.append({"event": "final_evaluation", "round": self.completed, "personalized_accuracy": summary,
                             "devices": len(self.ledger.final), "of_devices": self._device_count()})

    def _gather(self, targets: list[str], pool: Pool) -> None:
        """Ask `targets` for the pool's phase and pool their replies."""
        self._evaluate(self.completed, targets=targets, phase=pool.phase, pool=pool)

    # -- the report ------------------------------------------------------------------------
    def _report(self, wall_seconds: float) -> dict[str, Any]:
        rounds = self.ledger.rounds
        means = [r["personalized_accuracy"]["mean"] for r in rounds if r["personalized_accuracy"]]
        final = self.ledger.final or {}
        summary = summarize(m["accuracy"] for m in final.values() if not m.get("holdout")) or {}
        holdout = summarize(m["accuracy"] for m in final.values() if m.get("holdout"))
        global_summary = summarize(m["global_accuracy"] for m in final.values() if "global_accuracy" in m)
        by_kind = {kind: summarize(m["accuracy"] for m in final.values() if m.get("kind") == kind and not m.get("holdout"))
                   for kind in sorted({m.get("kind") for m in final.values()})}
        traffic = self.ledger.traffic()
        delivered = self.ledger.delivered()
        published_down = sum(traffic["sent"].values())
        return {
            "run_id": self.run_id,
            "algorithm": self.config.run.algorithm,
            "hyperparameters": to_plain(self.hyper),
            "dataset": self.config.run.dataset,
            "partition": self.config.run.partition,
            "model": self.config.model_name,
            "clients": self.config.run.clients,
            "fraction": self.config.round.fraction,
            "evaluated_on": "validation" if self.config.training.validation_fraction else "test",
            "rounds_completed": self.completed,
            "rounds_aggregated": sum(1 for r in rounds if r["outcome"] != "aborted"),
            "late_updates": {"policy": self.config.round.late_updates,
                             "folded": sum(r.get("late_folded", 0) for r in rounds),
                             "discarded": sum(r.get("late_discarded", 0) for r in rounds)},
            "rounds": rounds,
            "final": {
                "personalized_accuracy": {
                    "mean": summary.get("mean"),
                    "std": summary.get("std"),
                    "min": summary.get("min"),
                    "best_round_mean": max(means) if means else None,
                },
                "devices_evaluated": len(final),
                "devices_registered": self._device_count(),
                "per_client": {cid: final[cid] for cid in sorted(final)},
                "global_accuracy": global_summary["mean"] if global_summary else None,
                "holdout_accuracy": holdout,
                "by_kind": by_kind,
            },
            "release": self.release.manifest() | {"path": str(self.release.path)} if self.release else None,
            "communication": {
                "bytes_up": sum(traffic["received"].values()),
                "bytes_down": published_down,
                "bytes_down_published": published_down,
                "bytes_down_delivered": sum(delivered.values()),
                "by_kind": {"up": traffic["received"], "down": traffic["sent"], "down_delivered": delivered},
            },
            "rejections": self.ledger.rejections(),
            "duplicates_dropped": self.ledger.duplicates(),
            "events": self.ledger.event_counts(),
            "event_log": self.ledger.events,
            "wall_seconds": wall_seconds,
        }
