"""Prometheus metrics of a run, from the coordinator's events, in an exporter's own registry.

`PrometheusExporter` subscribes to a coordinator's `EventBus` and keeps counters, gauges and a
histogram named `edgepfl_*`, each labelled with the `federation`, in the CollectorRegistry it is
given (not the process-wide one, so two exporters in one process never collide). Traffic and
rejections are what the coordinator's channel counted during each round (`RoundEnded.channel`):
received is `up`, sent is `down`. `route()` serves them at `/metrics` of an `ObserveServer`.
Under DP (`private`) the exporter publishes nothing that depends on a device's data or on who
was sampled: no round's selected or participating devices, no upstream traffic (its message and
byte counts count the uploads) and no rejections; the run's progress, the fleet online, the
released accuracy and the epsilon remain.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from edge_sdk.protocol import Reason

from ..events import (DeviceOffline, DeviceOnline, DeviceRefused, DevicesRegistered, EventBus, ReleaseServed,
                      RoundEnded, RoundEvaluated, RoundStarted, RunStarted)
from .http import Request, Response

DIRECTIONS = {"received": "up", "sent": "down"}
"""The channel's directions as the metrics name them: the coordinator receives uploads."""
ROUND_SECONDS_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class PrometheusExporter:
    """The run's metrics in `registry`, kept up to date by the events it is fed (`attach`, `on_event`)."""

    EVENTS = (RunStarted, DevicesRegistered, RoundStarted, RoundEvaluated, RoundEnded, DeviceOnline, DeviceOffline,
              ReleaseServed, DeviceRefused)

    def __init__(self, registry: CollectorRegistry, *, federation: str = "default", private: bool = False) -> None:
        self.registry = registry
        self.federation = federation
        self.private = private
        labels = ["federation"]

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, labels, registry=registry)

        self.run = Info("edgepfl_run", "the run being played (run_id)", labels, registry=registry)
        self.rounds_planned = gauge("edgepfl_rounds_planned", "rounds the run plays in all")
        self.round = gauge("edgepfl_round", "the last round completed")
        self.rounds_completed = Counter("edgepfl_rounds_completed", "rounds completed by this coordinator process",
                                        labels, registry=registry)
        self.participants = gauge("edgepfl_round_participants", "fresh updates aggregated in the last round")
        self.selected = gauge("edgepfl_round_selected", "devices selected for the current round")
        self.round_seconds = Histogram("edgepfl_round_duration_seconds", "seconds a round took, evaluation included",
                                       labels, buckets=ROUND_SECONDS_BUCKETS, registry=registry)
        self.bytes = Counter("edgepfl_bytes", "encoded message bytes during rounds, by direction (up: received by "
                                              "the coordinator) and message kind", [*labels, "direction", "kind"],
                             registry=registry)
        self.messages = Counter("edgepfl_messages", "messages during rounds, by direction and message kind",
                                [*labels, "direction", "kind"], registry=registry)
        self.rejections = Counter("edgepfl_rejections", "messages the coordinator rejected, by reason",
                                  [*labels, "reason"], registry=registry)
        self.device_refusals = Counter("edgepfl_device_refusals", "requests devices refused themselves (what was "
                                                                  "sent does not fit their model), by reason",
                                       [*labels, "reason"], registry=registry)
        self.devices_registered = gauge("edgepfl_devices_registered", "devices registered (shard aggregators not "
                                                                      "counted)")
        self.devices_online = gauge("edgepfl_devices_online", "registered devices online (HELLO until Last Will)")
        self.accuracy = gauge("edgepfl_accuracy", "mean personalized accuracy of the last evaluation (under DP "
                                                  "with private evaluation: the noised mean released)")
        self.epsilon = gauge("edgepfl_epsilon", "privacy budget spent so far (--dp), at the run's delta")
        self.releases_served = Counter("edgepfl_releases_served", "released representations sent to devices "
                                                                  "that fetched them", labels, registry=registry)
        for reason in () if private else Reason:  # every reason from 0, so a rate is 0 rather than no data
            self.rejections.labels(federation, reason.value)
        self.rounds_completed.labels(federation)
        self.releases_served.labels(federation)

    def attach(self, bus: EventBus) -> None:
        """Subscribe to the events the metrics follow."""
        bus.subscribe(self.on_event, *self.EVENTS)

    def on_event(self, event: Any) -> None:
        """Update the metrics an event changes (others are ignored)."""
        federation = self.federation
        if isinstance(event, RunStarted):
            self.run.labels(federation).info({"run_id": event.run_id})
            self.rounds_planned.labels(federation).set(event.rounds)
            self.round.labels(federation).set(event.after_round)
        elif isinstance(event, DevicesRegistered):
            self.devices_registered.labels(federation).set(event.devices)
        elif isinstance(event, DeviceOnline):
            self.devices_online.labels(federation).set(event.online)
            self.devices_registered.labels(federation).set(event.registered)
        elif isinstance(event, DeviceOffline):
            self.devices_online.labels(federation).set(event.online)
        elif isinstance(event, RoundStarted) and not self.private:
            self.selected.labels(federation).set(len(event.selected))
        elif isinstance(event, RoundEvaluated) and event.accuracy is not None:
            self.accuracy.labels(federation).set(event.accuracy)
        elif isinstance(event, RoundEnded):
            self._round_ended(event)
        elif isinstance(event, ReleaseServed):
            self.releases_served.labels(federation).inc()
        elif isinstance(event, DeviceRefused):
            self.device_refusals.labels(federation, event.reason).inc()

    def _round_ended(self, event: RoundEnded) -> None:
        federation, record, channel = self.federation, event.record, event.channel
        self.rounds_completed.labels(federation).inc()
        self.round.labels(federation).set(event.round)
        self.round_seconds.labels(federation).observe(record["seconds"])
        for direction, name in DIRECTIONS.items():
            if self.private and name == "up":
                continue
            for kind, size in channel.bytes.get(direction, {}).items():
                self.bytes.labels(federation, name, kind).inc(size)
            for kind, count in channel.messages.get(direction, {}).items():
                self.messages.labels(federation, name, kind).inc(count)
        if not self.private:
            self.participants.labels(federation).set(record["participants"])
            for reason, count in channel.rejections.items():
                self.rejections.labels(federation, reason).inc(count)
        epsilon = (record.get("privacy") or {}).get("epsilon")
        if epsilon is not None:
            self.epsilon.labels(federation).set(epsilon)

    def text(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)

    def route(self, request: Request) -> Response:
        """`/metrics` of an `ObserveServer`."""
        return Response(self.text(), CONTENT_TYPE_LATEST)
