"""The coordinator: wires the round state machine, an algorithm, the channel and checkpoints.

One round: select devices (seeded) -> broadcast TRAIN once -> collect validated replies until
all / quorum+grace / deadline -> aggregate -> (evaluate) -> checkpoint -> one metrics line.
There are no algorithm branches here; everything algorithm-specific sits behind
`ServerAlgorithm`. Killed and restarted with the same `--out`, it resumes after the last
checkpointed round and never applies or records a round twice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from edge_sdk.channel import Channel, Received
from edge_sdk.config import from_mapping, to_plain
from edge_sdk.data import DATASETS
from edge_sdk.params import check_arrays
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, ProtocolError, Reason, check_client_id, new_message_id

from . import algorithms, checkpoint
from .algorithms.base import ServerContext
from .config import RunConfig
from .devices import DeviceRegistry
from .report import MetricsLog, summarize, write_report
from .rounds import Outcome, RoundCollector, select_clients

log = logging.getLogger(__name__)

SENDER = COORDINATOR


class RegistrationTimeout(RuntimeError):
    """Too few devices registered before the registration timeout."""


@dataclass
class RoundRecord:
    round: int
    selected: int
    participants: int
    outcome: str
    personalized_accuracy: dict | None
    global_accuracy: float | None
    bytes_up: int
    bytes_down: int
    seconds: float
    rejections: dict[str, int] = field(default_factory=dict)


class Coordinator:
    """Runs one federated training over a `Channel`; `run()` returns the report."""

    def __init__(
        self,
        config: RunConfig,
        channel: Channel,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.config = config
        self.channel = channel
        self.topics = channel.topics
        self.clock = clock
        self.on_round = on_round
        self.out = Path(config.out)
        self.registry = DeviceRegistry()
        algorithm_cls = algorithms.load(config.algorithm)
        self.hyper = from_mapping(algorithm_cls.Hyper, config.hyper, where=f"[algorithm.{config.algorithm}]")
        context = ServerContext(config.model_name, DATASETS[config.dataset], config.seed, config.rounds, config.clients)
        self.algorithm = algorithm_cls(self.hyper, context)
        self.incarnation = new_message_id()[:12]
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        self.history: dict[str, Any] = {"rounds": [], "sent": {}, "received": {}, "rejections": {}, "final": None}
        self.run_id = new_message_id()[:16]
        self.completed = 0
        self.final_eval: dict[str, dict[str, Any]] = {}
        self.holdout: frozenset[str] = frozenset()
        self._resume()

    # -- checkpoints -----------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.msgpack"

    def _resume(self) -> None:
        saved = checkpoint.load(self.checkpoint_path)
        if saved is None:
            return
        if saved.fingerprint != self.config.fingerprint():
            raise checkpoint.CheckpointError(
                f"{self.out} holds run {saved.run_id} with other settings; use another --out to start a new run"
            )
        self.run_id, self.completed, self.history = saved.run_id, saved.round, saved.history
        self.algorithm.state = saved.state
        for record in self.history["rounds"]:  # a crash between checkpoint and log line
            self.metrics.append({"event": "round", **record})
        log.info("resuming run %s after round %d", self.run_id, self.completed)

    def _checkpoint(self) -> None:
        sent, received = self._traffic_totals()
        self.history["sent"], self.history["received"] = sent, received
        self.history["rejections"] = self._rejection_totals()
        checkpoint.save(
            self.checkpoint_path,
            checkpoint.Checkpoint(self.run_id, self.completed, self.config.fingerprint(), self.algorithm.state, self.history),
        )

    def _traffic_totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """Bytes by kind over the whole run, earlier incarnations included."""
        now = self.channel.counter.by_kind()
        merged = []
        for direction in ("sent", "received"):
            base = dict(self._base_traffic[direction])
            for kind, n in now.get(direction, {}).items():
                base[kind] = base.get(kind, 0) + n
            merged.append(base)
        return merged[0], merged[1]

    def _rejection_totals(self) -> dict[str, int]:
        totals = dict(self._base_rejections)
        for reason, n in self.channel.rejections.items():
            totals[reason] = totals.get(reason, 0) + n
        return totals

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        started = time.time()
        self._base_traffic = {"sent": dict(self.history["sent"]), "received": dict(self.history["received"])}
        self._base_rejections = dict(self.history["rejections"])
        self.channel.transport.subscribe(self.topics.all_up())
        self._status("registering")
        self._await_devices()
        for round_ in range(self.completed + 1, self.config.rounds + 1):
            self._play_round(round_)
        if not self.final_eval and self.completed >= self.config.rounds:
            self.final_eval = self._evaluate(self.completed)  # resumed after the last round
        report = self._report(time.time() - started)
        write_report(self.out, report)
        self._status("finished")
        return report

    def _status(self, state: str) -> None:
        envelope = Envelope(
            Kind.STATUS,
            SENDER,
            run_id=self.run_id,
            round=self.completed,
            config={"state": state, "incarnation": self.incarnation, "rounds": self.config.rounds,
                    "algorithm": self.config.algorithm},
        )
        self.channel.send(self.topics.broadcast(Kind.STATUS), envelope, retain=True)

    def _await_devices(self) -> None:
        deadline = self.clock() + self.config.registration_timeout
        while len(self.registry.online("trainer")) < self.config.clients and self.clock() < deadline:
            self._serve(min(1.0, deadline - self.clock()), on_reply=self._stale_reply)
        have = len(self.registry.online("trainer"))
        if have < self.config.min_clients:
            raise RegistrationTimeout(
                f"only {have} trainer devices registered within {self.config.registration_timeout:.0f} s; "
                f"--min-clients is {self.config.min_clients}"
            )
        if self.config.holdout_clients:
            self.holdout = frozenset(self.registry.online("trainer")[-self.config.holdout_clients:])
            log.info("held out of training (heads only): %s", ", ".join(sorted(self.holdout)))
        log.info("%d devices registered (%d trainers); starting", len(self.registry.devices), have)

    # -- message handling ------------------------------------------------------------------
    def _serve(self, timeout: float, on_reply: Callable[[Received], None]) -> None:
        """Handle at most one message: registrations and liveness here, replies to `on_reply`."""
        received = self.channel.receive(max(0.0, timeout))
        if received is None:
            return
        envelope = received.envelope
        if envelope.kind is Kind.HELLO:
            self._register(envelope)
        elif envelope.kind is Kind.OFFLINE:
            self._offline(envelope.sender)
        elif envelope.kind in (Kind.TRAIN_RES, Kind.EVAL_RES):
            if envelope.run_id != self.run_id:
                self.channel.reject(Reason.WRONG_RUN, f"{envelope.sender}: run {envelope.run_id!r}")
            elif envelope.sender not in self.registry.devices:
                self.channel.reject(Reason.UNKNOWN_DEVICE, f"{envelope.sender} never registered")
            else:
                on_reply(received)

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
        if kind not in ("trainer", "lite") or not isinstance(examples, (int, float)) or examples < 1:
            self.channel.reject(Reason.MALFORMED, f"HELLO from {hello.sender}: device_type {kind!r}, examples {examples!r}")
            return
        if self.registry.register(hello.sender, kind, int(examples), hello.config):
            log.info("registered %s (%s, %d examples)", hello.sender, kind, examples)
        welcome = Envelope(
            Kind.WELCOME,
            SENDER,
            run_id=self.run_id,
            round=self.completed,
            config={
                "incarnation": self.incarnation,
                "algorithm": self.config.algorithm,
                "hyper": to_plain(self.hyper),
                "assignment": self.algorithm.assignment(hello.sender),
                "settings": {
                    "model": self.config.model_name,
                    "rounds": self.config.rounds,
                    "local_epochs": self.config.local_epochs,
                    "batch_size": self.config.batch_size,
                    "lr": self.config.lr,
                    "seed": self.config.seed,
                },
            },
        )
        self.channel.send(self.topics.down(hello.sender, Kind.WELCOME), welcome)

    def _offline(self, client_id: str) -> None:
        if client_id in self.registry.devices:
            log.info("%s went offline", client_id)
        self.registry.mark_offline(client_id)
        if self._collector is not None:
            self._collector.mark_offline(client_id)

    _collector: RoundCollector | None = None

    def _collect(self, collector: RoundCollector, on_reply: Callable[[Received], None]) -> Outcome:
        self._collector = collector
        try:
            while (outcome := collector.outcome(self.clock())) is Outcome.OPEN:
                self._serve(min(1.0, collector.time_left(self.clock())), on_reply)
            return outcome
        finally:
            self._collector = None

    def _admit(self, received: Received, kind: Kind, round_: int, collector: RoundCollector) -> bool:
        """Round, kind, selection and duplicate checks common to every reply."""
        envelope = received.envelope
        if envelope.kind is not kind or envelope.round != round_:
            self.channel.reject(Reason.STALE, f"{envelope.kind.value} from {envelope.sender} for round {envelope.round}")
            return False
        reason = collector.check(envelope.sender, envelope.msg_id)
        if reason is Reason.DUPLICATE:
            self.channel.duplicates += 1
            return False
        if reason is not None:
            self.channel.reject(reason, f"{envelope.kind.value} from {envelope.sender} in round {round_}")
            return False
        return True

    # -- one round -------------------------------------------------------------------------
    def _play_round(self, round_: int) -> None:
        started, (sent0, received0) = self.clock(), self.channel.counter.snapshot()
        rejections0 = dict(self.channel.rejections)
        candidates = [c for c in self.registry.online("trainer") if c not in self.holdout]
        selected = select_clients(candidates, self.config.fraction, self.config.seed, round_)
        self._status("training")
        self.algorithm.begin_round(round_)
        task = Envelope(
            Kind.TRAIN,
            SENDER,
            run_id=self.run_id,
            round=round_,
            groups=self.algorithm.task_groups(round_),
            config={"selected": selected, **self.algorithm.task_config(round_)},
        )
        self.channel.send(self.topics.broadcast(Kind.TRAIN), task)
        collector = RoundCollector(
            round_,
            frozenset(selected),
            min_replies=min(self.config.min_clients, len(selected)),
            deadline=self.clock() + self.config.round_timeout,
            grace=self.config.quorum_grace,
        )
        outcome = self._collect(collector, lambda r: self._on_update(r, round_, collector))
        if collector.enough:
            self.algorithm.end_round(round_)
        else:
            outcome = Outcome.DEADLINE
            log.warning("round %d: %d of %d replies, below the quorum of %d; global state unchanged",
                        round_, len(collector.replied), len(selected), collector.min_replies)
        evaluation = None
        if round_ % self.config.eval_every == 0 or round_ == self.config.rounds:
            evaluation = self.final_eval = self._evaluate(round_)
        sent1, received1 = self.channel.counter.snapshot()
        accuracies = [m["accuracy"] for cid, m in (evaluation or {}).items() if cid not in self.holdout]
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
            rejections={k: v - rejections0.get(k, 0) for k, v in self.channel.rejections.items() if v != rejections0.get(k, 0)},
        )
        entry = record.__dict__.copy()
        self.completed = round_
        self.history["rounds"].append(entry)
        self.history["final"] = self.final_eval
        self._checkpoint()
        self.metrics.append({"event": "round", **entry})
        acc = (record.personalized_accuracy or {}).get("mean")
        log.info("round %d/%d: %s, %d/%d replied, accuracy %s, %.2f MB, %.1f s", round_, self.config.rounds,
                 record.outcome, record.participants, record.selected,
                 f"{acc:.4f}" if acc is not None else "-", (record.bytes_up + record.bytes_down) / 1e6, record.seconds)
        if self.on_round is not None:
            self.on_round(entry)

    def _on_update(self, received: Received, round_: int, collector: RoundCollector) -> None:
        envelope = received.envelope
        if not self._admit(received, Kind.TRAIN_RES, round_, collector):
            return
        try:
            spec = self.algorithm.update_spec(round_)
            if set(envelope.groups) != set(spec):
                raise ProtocolError(Reason.UNEXPECTED_ARRAYS, f"groups {sorted(envelope.groups)}, want {sorted(spec)}")
            for group, expected in spec.items():
                check_arrays(group, envelope.groups[group], expected)
            claimed = envelope.metrics.get("num_examples")
            if not isinstance(claimed, (int, float)) or claimed < 1:
                raise ProtocolError(Reason.MALFORMED, f"num_examples {claimed!r}")
            registered = self.registry.devices[envelope.sender].num_examples
            self.algorithm.validate_update(envelope.sender, envelope.groups, envelope.metrics, registered)
        except ProtocolError as err:
            self.channel.reject(err.reason, f"update from {envelope.sender}: {err.detail}")
            return
        weight = min(float(claimed), registered, self.config.max_examples)
        self.algorithm.accumulate(envelope.sender, envelope.groups, envelope.metrics, weight)
        collector.accept(envelope.sender, envelope.msg_id, self.clock())

    # -- evaluation ------------------------------------------------------------------------
    def _evaluate(self, round_: int) -> dict[str, dict[str, Any]]:
        """Every online device evaluates the model it would deploy on its own test split."""
        targets = self.registry.online()
        if not targets:
            return {}
        self._status("evaluating")
        request = Envelope(Kind.EVALUATE, SENDER, run_id=self.run_id, round=round_,
                           groups=self.algorithm.eval_groups(),
                           config={"selected": targets, "final": round_ >= self.config.rounds})
        self.channel.send(self.topics.broadcast(Kind.EVALUATE), request)
        collector = RoundCollector(round_, frozenset(targets), min_replies=len(targets),
                                   deadline=self.clock() + self.config.round_timeout, grace=0.0)
        results: dict[str, dict[str, Any]] = {}

        def on_result(received: Received) -> None:
            envelope = received.envelope
            if not self._admit(received, Kind.EVAL_RES, round_, collector):
                return
            accuracy = envelope.metrics.get("accuracy")
            if not isinstance(accuracy, (int, float)) or not 0.0 <= accuracy <= 1.0:
                self.channel.reject(Reason.MALFORMED, f"evaluation from {envelope.sender}: accuracy {accuracy!r}")
                return
            results[envelope.sender] = {"kind": self.registry.kind_of(envelope.sender),
                                        "holdout": envelope.sender in self.holdout, **envelope.metrics}
            collector.accept(envelope.sender, envelope.msg_id, self.clock())

        self._collect(collector, on_result)
        missing = set(targets) - set(results)
        if missing:
            log.warning("round %d evaluation: no result from %s", round_, ", ".join(sorted(missing)))
        return results

    # -- the report ------------------------------------------------------------------------
    def _report(self, wall_seconds: float) -> dict[str, Any]:
        rounds = self.history["rounds"]
        means = [r["personalized_accuracy"]["mean"] for r in rounds if r["personalized_accuracy"]]
        final = self.final_eval or self.history.get("final") or {}
        summary = summarize(m["accuracy"] for cid, m in final.items() if not m.get("holdout")) or {}
        holdout = summarize(m["accuracy"] for m in final.values() if m.get("holdout"))
        global_summary = summarize(m["global_accuracy"] for m in final.values() if "global_accuracy" in m)
        sent, received = self._traffic_totals()
        return {
            "run_id": self.run_id,
            "algorithm": self.config.algorithm,
            "hyperparameters": to_plain(self.hyper),
            "dataset": self.config.dataset,
            "partition": self.config.partition,
            "model": self.config.model_name,
            "clients": self.config.clients,
            "fraction": self.config.fraction,
            "rounds_completed": self.completed,
            "rounds": rounds,
            "final": {
                "personalized_accuracy": {
                    "mean": summary.get("mean"),
                    "std": summary.get("std"),
                    "min": summary.get("min"),
                    "best_mean": max(means) if means else None,
                },
                "per_client": {cid: final[cid] for cid in sorted(final)},
                "global_accuracy": global_summary["mean"] if global_summary else None,
                "holdout_accuracy": holdout,
            },
            "communication": {
                "bytes_up": sum(received.values()),
                "bytes_down": sum(sent.values()),
                "by_kind": {"up": received, "down": sent},
            },
            "rejections": self._rejection_totals(),
            "wall_seconds": wall_seconds,
        }
