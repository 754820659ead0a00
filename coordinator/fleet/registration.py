"""Who takes part in a run: HELLOs checked and answered, the fleet awaited before round 1.

A HELLO from a valid, non-reserved id with a known device type and a plausible example count
registers (or refreshes) a trainer or weak device and is answered with a WELCOME: the run, the
algorithm and its hyperparameters, the device's assignment, the training settings and the run
model's signature (a trainer bringing a model of its own that differs is refused, with the
first parameter that differs). Shard aggregators (`aggregator-<k>`, `shards` K > 0) register
the same way and get the run's aggregation settings. Before round 1 the coordinator waits until
`clients` devices and every shard's aggregator are online, or the registration timeout.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from edge_sdk.config import to_plain
from edge_sdk.models import (ModelSpec, Signature, build_model, first_mismatch, model_signature, signature_from_plain,
                             signature_to_plain)
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Reason, aggregator_id, check_client_id, shard_of_aggregator
from edge_sdk.privacy.disclosure import EXAMPLES_BUCKET, MAX_BUCKET
from edge_sdk.privacy.upstream import PRIVACY
from edge_sdk.secagg import stages as secagg_stages

from ..aggregation.validation import UpdateLimits
from ..algorithms.base import ServerAlgorithm
from ..config.run_config import RunConfig
from ..events import DevicesRegistered, EventBus, RegistrationOpened
from ..run.ledger import Ledger
from ..shards.sharding import AGGREGATOR, shard_of
from .devices import DeviceRegistry
from .outbox import Outbox

log = logging.getLogger(__name__)


class RegistrationTimeout(RuntimeError):
    """Too few devices registered before the registration timeout."""


class Registration:
    """The run's registrations: HELLO in, WELCOME (or a refusal) out, the registry kept."""

    def __init__(self, config: RunConfig, algorithm: ServerAlgorithm, hyper: Any, model: ModelSpec,
                 limits: UpdateLimits, registry: DeviceRegistry, outbox: Outbox, ledger: Ledger, incarnation: str,
                 *, privacy: dict[str, Any] | None = None, data_private: bool = False):
        self.config = config
        self.algorithm = algorithm
        self.hyper = hyper
        self.model = model
        self.limits = limits
        self.registry = registry
        self.outbox = outbox
        self.ledger = ledger
        self.incarnation = incarnation
        self.shards = config.round.shards
        self.privacy = privacy
        """A private run's resolved `[privacy]` settings, which every WELCOME carries (None: no DP)."""
        self.data_private = data_private
        """User-level DP: devices say nothing of their data in HELLO, and nothing they say is kept."""
        self._model_signature: Signature | None = None

    # -- the fleet -------------------------------------------------------------------------
    def await_fleet(self, serve: Callable[[float], None], clock: Callable[[], float],
                    events: EventBus) -> frozenset[str]:
        """Handle messages (`serve(timeout)`) until `clients` devices have registered and every
        shard's aggregator is online, or the registration timeout passed; raise
        `RegistrationTimeout` without an aggregator or below `min_clients` trainers online.
        Returns the held-out trainers. A device that registered and went offline since counts:
        in a fleet whose devices come and go, all of them are seldom online at once."""
        settings = self.config.round
        opened = clock()
        events.emit(RegistrationOpened(self.config.run.clients))
        deadline = opened + settings.registration_timeout
        while ((self.device_count() < self.config.run.clients or self.aggregators_missing())
               and clock() < deadline):
            serve(min(1.0, deadline - clock()))
        missing = self.aggregators_missing()
        if missing:
            raise RegistrationTimeout(
                f"shard aggregators {', '.join(map(aggregator_id, missing))} did not register within "
                f"{settings.registration_timeout:.0f} s; start `edgepfl aggregator --shard k/{self.shards}` "
                "for each")
        have = len(self.registry.online("trainer"))
        if have < settings.min_clients:
            raise RegistrationTimeout(
                f"only {have} trainer devices registered within {settings.registration_timeout:.0f} s; "
                f"--min-clients is {settings.min_clients}"
            )
        holdout: frozenset[str] = frozenset()
        if settings.holdout_clients:
            holdout = frozenset(self.registry.online("trainer")[-settings.holdout_clients:])
            log.info("held out of training (heads only): %s", ", ".join(sorted(holdout)))
        devices = self.device_count()
        log.info("%d devices registered (%d trainers)%s; starting", devices, have,
                 f" and {self.shards} shard aggregators" if self.shards else "")
        events.emit(DevicesRegistered(devices, have, clock() - opened))
        return holdout

    def device_count(self) -> int:
        """Registered devices (trainers and weak ones; shard aggregators are not devices)."""
        return sum(1 for device in self.registry.devices.values() if device.kind != AGGREGATOR)

    def aggregators_missing(self) -> list[int]:
        """Shards whose aggregator is not online."""
        online = set(self.registry.online(AGGREGATOR))
        return [k for k in range(self.shards) if aggregator_id(k) not in online]

    def went_offline(self, client_id: str) -> None:
        """A device's Last Will: it is offline until its next HELLO."""
        if client_id in self.registry.devices and self.registry.devices[client_id].online:
            log.info("%s went offline", client_id)
            self.ledger.event("offline", device=client_id, round=self.outbox.position.completed + 1)
        self.registry.mark_offline(client_id)

    # -- HELLO -----------------------------------------------------------------------------
    def on_hello(self, hello: Envelope) -> None:
        kind = hello.config.get("device_type", "trainer")
        examples = hello.metrics.get("num_examples", 0)
        try:
            check_client_id(hello.sender)
        except ValueError as exc:
            self.outbox.reject(hello, Reason.MALFORMED, f"HELLO: {exc}")
            return
        if kind == AGGREGATOR or shard_of_aggregator(hello.sender) is not None:
            self._register_aggregator(hello)
            return
        if self.data_private:  # a device of a private run says nothing of its data: none of it is kept
            examples, capabilities = 0, {k: v for k, v in hello.config.items() if k != "label_counts"}
        elif self.config.secagg.secure_aggregation:  # only a bound on its examples: the weights' scale
            bound, capabilities = self._bucketed(hello)
            if bound is None:
                return
            examples = bound
        else:
            capabilities = hello.config
        if (kind not in ("trainer", "lite") or not isinstance(examples, (int, float))
                or not math.isfinite(examples) or (examples < 1 and not self.data_private)):
            self.outbox.reject(hello, Reason.MALFORMED,
                               f"HELLO from {hello.sender}: device_type {kind!r}, examples {examples!r}")
            return
        spoken = hello.config.get(secagg_stages.CAPABILITY)
        if self.config.secagg.secure_aggregation and spoken != secagg_stages.VERSION:
            remedy = (f"it speaks version {spoken}: update its edgepfl" if isinstance(spoken, int) else
                      "give the device its secure-aggregation keys (--secagg-identity, --secagg-roster) on an edgepfl "
                      "with the secagg extra")
            refusal = (f"this run requires secure aggregation (version {secagg_stages.VERSION}), which {hello.sender} "
                       f"does not speak: {remedy}")
            self.outbox.reject(hello, Reason.SECAGG_INVALID, f"HELLO: {refusal}")
            self._refuse(hello.sender, refusal)
            return
        mismatch = self._model_mismatch(hello) if kind == "trainer" else None
        if mismatch is not None:
            self.outbox.reject(hello, Reason.MODEL_MISMATCH, f"HELLO from {hello.sender}: {mismatch}")
            self._refuse(hello.sender, f"its model differs from the run's: {mismatch}")
            return
        known = hello.sender in self.registry.devices
        self.registry.register(hello.sender, kind, int(examples), capabilities)
        self.ledger.event("rejoined" if known else "registered", device=hello.sender,
                          round=self.outbox.position.completed + 1)
        log.info("%s %s (%s, %d examples)", "re-registered" if known else "registered", hello.sender, kind, examples)
        self.outbox.send(self.outbox.topics.down(hello.sender, Kind.WELCOME), self.welcome(hello.sender))

    def _bucketed(self, hello: Envelope) -> tuple[int | None, dict[str, Any]]:
        """Under secure aggregation: (2^b for the HELLO's `examples_bucket` b, its config without
        label counts); (None, {}) for a HELLO without a valid bucket, rejected and named. Exact
        counts that arrive anyway are not kept."""
        bucket = hello.metrics.get(EXAMPLES_BUCKET)
        if isinstance(bucket, bool) or not isinstance(bucket, int) or not 0 <= bucket <= MAX_BUCKET:
            self.outbox.reject(hello, Reason.MALFORMED, f"HELLO from {hello.sender}: {EXAMPLES_BUCKET} {bucket!r}, "
                                                        f"not an int in [0, {MAX_BUCKET}] (secure aggregation)")
            return None, {}
        capabilities = {k: v for k, v in hello.config.items() if k != "label_counts"}
        return 2 ** bucket, {**capabilities, EXAMPLES_BUCKET: bucket}

    def _register_aggregator(self, hello: Envelope) -> None:
        """A shard aggregator: `aggregator-<k>` with device_type "aggregator", for one of this
        run's shards; it gets the run's aggregation settings, or a refusal that says why not."""
        shard, kind = shard_of_aggregator(hello.sender), hello.config.get("device_type")
        if kind != AGGREGATOR or hello.config.get("shard") != shard:
            self.outbox.reject(hello, Reason.MALFORMED, f"HELLO from {hello.sender}: ids aggregator-<k> are reserved "
                                                        f"for the aggregator of shard k (device_type {kind!r})")
            return
        if not self.shards or shard is None or shard >= self.shards or hello.config.get("shards") != self.shards:
            refusal = (f"this run has shards {self.shards}; {hello.sender} came as shard {shard} of "
                       f"{hello.config.get('shards')!r}")
            self.outbox.reject(hello, Reason.MALFORMED, f"HELLO: {refusal}")
            self._refuse(hello.sender, refusal)
            return
        known = hello.sender in self.registry.devices
        self.registry.register(hello.sender, AGGREGATOR, 0, hello.config)
        self.ledger.event("rejoined" if known else "registered", device=hello.sender,
                          round=self.outbox.position.completed + 1)
        log.info("%s shard aggregator %s", "re-registered" if known else "registered", hello.sender)
        self.outbox.send(self.outbox.topics.down(hello.sender, Kind.WELCOME), self.welcome(hello.sender))

    def _refuse(self, client_id: str, why: str) -> None:
        """A WELCOME that refuses the registration, saying why."""
        position = self.outbox.position
        self.outbox.send(self.outbox.topics.down(client_id, Kind.WELCOME),
                         Envelope(Kind.WELCOME, COORDINATOR, run_id=position.run_id, round=position.completed,
                                  config={"refused": why}))

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

    # -- WELCOME ---------------------------------------------------------------------------
    def welcome(self, client_id: str) -> Envelope:
        """The WELCOME a registered device receives: the run, the algorithm with its
        hyperparameters, the device's assignment and the training settings; under sharded
        aggregation a trainer's `shard`, and a shard aggregator what it checks and sums with."""
        position = self.outbox.position
        if self.registry.kind_of(client_id) == AGGREGATOR:
            return Envelope(Kind.WELCOME, COORDINATOR, run_id=position.run_id, round=position.completed,
                            config={"incarnation": self.incarnation, "algorithm": self.config.run.algorithm,
                                    "hyper": to_plain(self.hyper), "aggregation": self._aggregation_settings()})
        config: dict[str, Any] = {
            "incarnation": self.incarnation,
            "algorithm": self.config.run.algorithm,
            "hyper": to_plain(self.hyper),
            "assignment": self.algorithm.assignment(client_id),
            "settings": self.config.welcome_settings(),
            "model_signature": signature_to_plain(self.model_signature),
        }
        if self.privacy is not None:
            config[PRIVACY] = self.privacy
        if self.config.secagg.secure_aggregation:  # a weak device then sends its prototypes only masked
            config[secagg_stages.SECURE] = True
        if self.shards and self.registry.kind_of(client_id) == "trainer":
            config["shard"] = shard_of(client_id, self.shards)
        return Envelope(Kind.WELCOME, COORDINATOR, run_id=position.run_id, round=position.completed, config=config)

    def _aggregation_settings(self) -> dict[str, Any]:
        """What a shard aggregator needs to check and sum updates as this coordinator would."""
        context = self.algorithm.context
        return {"model": self.config.model_name, "task": context.task.to_plain(), "seed": context.seed,
                "rounds": context.rounds, "clients": context.clients, "rule": asdict(context.aggregation),
                "max_examples": self.limits.max_examples, "max_update_norm": self.limits.max_update_norm,
                "upload_codec": self.config.training.upload_codec,
                "topk_fraction": self.config.training.topk_fraction}
