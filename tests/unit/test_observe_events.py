"""The coordinator's fleet events (DeviceOnline, DeviceOffline, ReleaseServed) in runs over the
loopback broker (tests/loopback_runs.py), and the metrics they make through the Prometheus exporter."""

from __future__ import annotations

import pytest

from coordinator.events import DeviceOffline, DeviceOnline, RegistrationOpened, ReleaseServed
from edge_sdk import wire
from edge_sdk.protocol import Envelope, Kind

pytest.importorskip("prometheus_client")


def _exporter(coordinator):
    from prometheus_client import CollectorRegistry

    from coordinator.observe.prometheus import PrometheusExporter

    registry = CollectorRegistry()
    PrometheusExporter(registry, federation=coordinator.topics.federation).attach(coordinator.events)
    return registry


def test_a_weak_device_fetching_the_release_is_served_online_and_counted(federation):
    # Prepare: RepPer releases its body; dev002 is a weak device that fetches it
    coordinator = federation.coordinator(federation.config(algorithm="repper", rounds=1))
    registry = _exporter(coordinator)
    fleet: list = []
    coordinator.subscribe(fleet.append, DeviceOnline, DeviceOffline, ReleaseServed)
    federation.start_device(0, 3)
    federation.start_device(1, 3)
    federation.start_lite(2, 3)

    # Execute
    report = coordinator.run()

    # Assert
    served = [e for e in fleet if isinstance(e, ReleaseServed)]
    assert [(e.device, e.sha256) for e in served] == [("dev002", report["release"]["sha256"])]
    assert served[0].bytes == federation.folder.release.stat().st_size
    kinds = {e.device: e.kind for e in fleet if isinstance(e, DeviceOnline)}
    assert kinds == {"dev000": "trainer", "dev001": "trainer", "dev002": "lite"}
    labels = {"federation": federation.topics.federation}
    assert registry.get_sample_value("edgepfl_releases_served_total", labels) == 1
    assert registry.get_sample_value("edgepfl_devices_online", labels) == 3
    assert registry.get_sample_value("edgepfl_devices_registered", labels) == 3


def test_a_device_gone_offline_is_an_event_and_leaves_the_online_gauge(federation):
    # Prepare: while registration is open, dev009 registers and its Last Will follows
    coordinator = federation.coordinator(federation.config(rounds=1))
    registry = _exporter(coordinator)
    visitor = federation.broker.transport("dev009")
    visitor.connect()
    hello = Envelope(Kind.HELLO, "dev009", metrics={"num_examples": 100, "num_test": 20},
                     config={"device_type": "trainer"})

    def visit(event: RegistrationOpened) -> None:
        visitor.publish(federation.topics.up("dev009", Kind.HELLO), wire.encode(hello))
        visitor.publish(federation.topics.up("dev009", Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, "dev009")))

    coordinator.subscribe(visit, RegistrationOpened)
    fleet: list = []
    coordinator.subscribe(fleet.append, DeviceOnline, DeviceOffline)
    for index in range(3):
        federation.start_device(index, 3)

    # Execute
    report = coordinator.run()

    # Assert: dev009 went offline once, leaving those online before it
    (offline,) = [e for e in fleet if isinstance(e, DeviceOffline)]
    before = fleet[:fleet.index(offline)]
    assert offline.device == "dev009" and ("dev009", "trainer") in [(e.device, e.kind) for e in before]
    assert offline.online == len({e.device for e in before} - {"dev009"})
    assert report["rounds_completed"] == 1
    labels = {"federation": federation.topics.federation}
    assert registry.get_sample_value("edgepfl_devices_online", labels) == 3
    assert registry.get_sample_value("edgepfl_devices_registered", labels) == 4
