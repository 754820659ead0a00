"""The trainer client: receive a task, run the announced algorithm locally, send the result.

The device registers with HELLO (again whenever a new coordinator incarnation appears on the
retained status topic), learns the run's algorithm and settings from WELCOME, trains when a
broadcast TRAIN selects it, and evaluates its deployed model on EVALUATE. Its personal state is
saved atomically after every round and reloaded after a restart; it never goes upstream.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from . import algorithms, wire
from .algorithms.base import DeviceAlgorithm, Task, TrainSettings
from .attacks import corrupt
from .channel import Channel, Received
from .chunks import DEFAULT_CHUNK_SIZE
from .config import from_mapping
from .data import ClientData
from .protocol import Envelope, Kind, ProtocolError, Reason, Topics, check_client_id
from .store import PersonalState, PersonalStore
from .transport import MqttSettings, MqttTransport

log = logging.getLogger(__name__)


class EdgeClient:
    """One trainer device. `run()` blocks until the run finishes or `stop` is set."""

    def __init__(
        self,
        client_id: str,
        data: ClientData,
        *,
        broker: MqttSettings | str = "mqtt://127.0.0.1:1883",
        federation: str = "default",
        state_dir: str | Path = "edgepfl-state",
        device: str = "auto",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        exit_on_finish: bool = True,
        hello_interval: float = 15.0,
        compute_lock: threading.Lock | None = None,
        transport=None,
        attack: str | None = None,
    ):
        self.client_id = check_client_id(client_id)
        self.data = data
        self.topics = Topics(federation)
        self.device = device
        self.exit_on_finish = exit_on_finish
        self.hello_interval = hello_interval
        self.store = PersonalStore(state_dir)
        self.attack = attack
        if attack is not None:
            log.warning("%s behaves as an adversary: its uploads are corrupted (%s)", client_id, attack)
        self._compute_lock = compute_lock or nullcontext()
        will = (self.topics.up(client_id, Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, client_id)))
        if transport is None:
            settings = MqttSettings(url=broker) if isinstance(broker, str) else broker
            transport = MqttTransport(f"{federation}.{client_id}", settings, will=will)
        self.channel = Channel(transport, self.topics, chunk_size=chunk_size)
        self.run_id: str | None = None
        self.algorithm: DeviceAlgorithm | None = None
        self.algorithm_id: str | None = None
        self.rounds_trained = 0
        self._announcement: tuple | None = None
        self._last_hello = float("-inf")
        self._connections_at_hello = 0
        self._finished = False
        self._replies: dict[Kind, Envelope] = {}  # the last reply of each kind, for repeated requests

    # -- lifecycle -------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        self.channel.transport.connect()
        try:
            for topic_filter in self.topics.device_subscriptions(self.client_id):
                self.channel.transport.subscribe(topic_filter)
            self._hello()
            while not stop.is_set() and not self._finished:
                received = self.channel.receive(timeout=0.5)
                if received is not None:
                    self._handle(received)
                elif self._should_hello():
                    self._hello()
        finally:
            self.channel.transport.close()

    def _should_hello(self) -> bool:
        """Register again after a reconnection (the coordinator saw our Last Will), or while no
        coordinator has answered yet."""
        reconnected = getattr(self.channel.transport, "connections", 1) != self._connections_at_hello
        unanswered = self.run_id is None and time.monotonic() - self._last_hello > self.hello_interval
        return reconnected or unanswered

    def _send(self, kind: Kind, round_: int = 0, **fields) -> None:
        envelope = Envelope(kind, self.client_id, run_id=self.run_id or "", round=round_, **fields)
        self.channel.send(self.topics.up(self.client_id, kind), envelope)
        if kind in (Kind.TRAIN_RES, Kind.EVAL_RES):
            self._replies[kind] = envelope

    def _answered(self, request: Envelope, reply_kind: Kind) -> bool:
        """A request repeated (after a reconnection, or by a restarted coordinator) gets the same
        reply again, message id included, so the work is neither redone nor applied twice."""
        reply = self._replies.get(reply_kind)
        if reply is None or (reply.run_id, reply.round) != (request.run_id, request.round):
            return False
        self.channel.send(self.topics.up(self.client_id, reply_kind), reply)
        return True

    def _hello(self) -> None:
        import torch

        self._last_hello = time.monotonic()
        self._connections_at_hello = getattr(self.channel.transport, "connections", 1)
        self._send(
            Kind.HELLO,
            metrics={"num_examples": self.data.num_train, "num_test": self.data.num_test},
            config={
                "device_type": "trainer",
                "accelerator": self.device,
                "torch": torch.__version__,
                "dataset": self.data.meta.name,
                "algorithms": list(algorithms.ALGORITHM_IDS),
            },
        )

    # -- messages --------------------------------------------------------------------------
    def _handle(self, received: Received) -> None:
        envelope = received.envelope
        handlers = {
            Kind.STATUS: self._on_status,
            Kind.WELCOME: self._on_welcome,
            Kind.TRAIN: self._on_train,
            Kind.EVALUATE: self._on_evaluate,
        }
        try:
            handlers[envelope.kind](envelope)
        except ProtocolError as err:
            self.channel.reject(err.reason, f"{envelope.kind.value} round {envelope.round}: {err.detail}")
        except (ValueError, KeyError, TypeError) as exc:  # e.g. a WELCOME naming an unknown algorithm
            self.channel.reject(Reason.MALFORMED, f"{envelope.kind.value}: {type(exc).__name__}: {exc}")

    def _on_status(self, status: Envelope) -> None:
        # a new coordinator process, or the coordinator back from a broker outage: register again
        announcement = (status.config.get("incarnation"), status.config.get("epoch"))
        if status.config.get("state") == "finished":
            if status.run_id == self.run_id and self.exit_on_finish:
                log.info("%s: run %s finished", self.client_id, self.run_id)
                self._finished = True
            return
        if announcement != self._announcement:
            self._announcement = announcement
            self._hello()

    def _on_welcome(self, welcome: Envelope) -> None:
        algorithm_id = welcome.config["algorithm"]
        if self.algorithm is not None and (welcome.run_id, algorithm_id) == (self.run_id, self.algorithm_id):
            return  # a repeated registration within the same run
        algorithm_cls = algorithms.load(algorithm_id)
        hyper = from_mapping(algorithm_cls.Hyper, welcome.config.get("hyper", {}), where=f"algorithm.{algorithm_id}")
        settings = from_mapping(TrainSettings, welcome.config["settings"], where="settings")
        seed = settings.seed * 1_000_003 + sum(self.client_id.encode())
        self.algorithm = algorithm_cls(hyper, settings, self.data, self.device, seed,
                                       welcome.config.get("assignment", {}))
        self.run_id, self.algorithm_id = welcome.run_id, algorithm_id
        saved = self.store.load()
        if saved is not None and (saved.run_id, saved.algorithm) == (self.run_id, algorithm_id):
            self.algorithm.load_personal_state(saved.arrays)
            self.rounds_trained = saved.round
            log.info("%s: personal state of round %d restored", self.client_id, saved.round)
        log.info("%s: joined run %s (%s)", self.client_id, self.run_id, algorithm_id)

    def _current(self, envelope: Envelope) -> bool:
        """True if the message belongs to the run this device has joined; re-registers if not."""
        if self.algorithm is None or envelope.run_id != self.run_id:
            self._hello()
            return False
        selected = envelope.config.get("selected")
        return isinstance(selected, list) and self.client_id in selected

    def _on_train(self, envelope: Envelope) -> None:
        if not self._current(envelope) or self._answered(envelope, Kind.TRAIN_RES):
            return
        task = Task(envelope.round, envelope.groups, envelope.config)
        with self._compute_lock:
            result = self.algorithm.fit(task)
        self.rounds_trained = envelope.round
        self.store.save(PersonalState(self.run_id, self.algorithm_id, envelope.round, self.algorithm.personal_state()))
        groups = result.groups
        if self.attack is not None:
            rng = np.random.default_rng([sum(self.client_id.encode()), envelope.round])
            groups = corrupt(self.attack, groups, envelope.groups, rng)
        self._send(Kind.TRAIN_RES, envelope.round, groups=groups, metrics=result.metrics)

    def _on_evaluate(self, envelope: Envelope) -> None:
        if not self._current(envelope) or self._answered(envelope, Kind.EVAL_RES):
            return
        with self._compute_lock:
            metrics = self.algorithm.evaluate(Task(envelope.round, envelope.groups, envelope.config))
        self._send(Kind.EVAL_RES, envelope.round, metrics=metrics)
