"""`edgepfl workers`: a share of a simulation's virtual devices, hosted on another host.

A simulation of thousands of clients outgrows one machine; `edgepfl simulate` then hosts its
own share of the devices (`--local-devices`) and waits for all `clients` to register, and
`edgepfl workers --devices 100-199` hosts another share on each further host, in the same
worker processes as simulate's (`simulate.WorkerPool`), over the broker both name.

The run's settings come from this host's own flags and `--config`, the same as simulate's, not
from the network: a coordinator only says what the run is, and this host decides what data it
reads and what model code it imports. Before any device starts, `announced_settings` waits for
the coordinator's retained STATUS `registering`, which carries the settings that define the run
(`RunConfig.defining`, plain msgpack values); every one of them must equal this host's, or the
devices are refused with a message naming each setting that differs. Device i then loads the
same partition as it would in a one-host simulation (index i of `clients` under the run's
dataset, partition, alpha and seed).

Once the devices have joined, the per-device memory is measured (`Footprint`); the command ends
when the run finishes (the devices leave on STATUS `finished`), failing if any device failed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

from edge_sdk.channel import Channel
from edge_sdk.config import ConfigError
from edge_sdk.protocol import Kind, Topics
from edge_sdk.transport import MqttTransport

from ..config.run_config import RunConfig
from .device_ranges import client_id_for, describe_indices
from .lifecycle import sigint_blocked
from .simulate import Hosting, WorkerPool

log = logging.getLogger(__name__)

REGISTERING = "registering"


class RunNotAnnounced(RuntimeError):
    """No coordinator announced a run that registers devices on the federation in time."""


class DevicesFailed(RuntimeError):
    """Hosted devices failed, or never joined the run; the message names them and why."""


def announced_settings(config: RunConfig, url: str, account: str, timeout: float) -> dict[str, Any]:
    """The settings of the run the federation's coordinator announces while it registers devices
    (its retained STATUS `registering`), waiting up to `timeout` seconds for it. Connects as
    `account` (a hosted device's credentials) under a client id of its own."""
    federation = config.broker.federation
    topics = Topics(federation)
    transport = MqttTransport(f"{federation}.{account}.workers", config.mqtt_settings(url, account=account))
    transport.connect()
    seen = "no STATUS at all"
    try:
        channel = Channel(transport, topics)
        transport.subscribe(topics.broadcast(Kind.STATUS))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            received = channel.receive(min(1.0, left))
            if received is None or received.envelope.kind is not Kind.STATUS:
                continue
            status = received.envelope.config
            if status.get("state") == REGISTERING:
                settings = status.get("settings")
                if not isinstance(settings, dict):
                    raise ConfigError(f"the coordinator of federation {federation} announces no run settings to "
                                      "check these devices against (a coordinator older than `edgepfl workers`?)")
                return settings
            seen = f"its STATUS is {status.get('state')!r} (run {received.envelope.run_id})"
    finally:
        transport.close()
    raise RunNotAnnounced(f"no coordinator registered devices on federation {federation} at {url} within "
                          f"{timeout:.0f} s ({seen}): start `edgepfl simulate` (or `edgepfl coordinator`) with the "
                          "same --broker and --federation, before or while these workers wait")


def settings_mismatch(here: dict[str, Any], announced: dict[str, Any]) -> list[str]:
    """One line per setting whose value here differs from the coordinator's, by key."""
    return [f"{key}: {here.get(key)!r} here, {announced.get(key)!r} at the coordinator"
            for key in sorted(set(here) | set(announced)) if here.get(key) != announced.get(key)]


def check_settings(config: RunConfig, announced: dict[str, Any]) -> None:
    """Refuse to host devices of a run whose settings differ from this host's."""
    differences = settings_mismatch(config.defining(), announced)
    if differences:
        raise ConfigError(f"these devices would not be the run's: settings differ from the run the coordinator "
                          f"announces on federation {config.broker.federation}: {'; '.join(differences)} (give "
                          "`edgepfl workers` the same --config and flags as `edgepfl simulate`)")


@dataclass(frozen=True)
class Footprint:
    """The memory of the hosted devices once they joined, over every worker process: RSS after
    the devices joined minus RSS before the first one started, per device."""

    devices: int
    processes: int
    rss_before: int
    """Over the processes: torch, the SDK and the interpreter, before any device."""
    rss_after: int

    @classmethod
    def of(cls, reports: Sequence[Hosting]) -> Footprint:
        return cls(sum(r.devices for r in reports), len(reports), sum(r.rss_before for r in reports),
                   sum(r.rss_after for r in reports))

    @property
    def per_device(self) -> float | None:
        """Bytes of RSS each hosted device added (None without any device)."""
        return (self.rss_after - self.rss_before) / self.devices if self.devices else None

    def describe(self) -> str:
        per_device = "-" if self.per_device is None else f"{self.per_device / 2**20:.1f} MiB"
        return (f"{self.devices} devices joined in {self.processes} worker processes: RSS {per_device} per device "
                f"(RSS after they joined minus before, over {self.devices}; "
                f"{self.rss_before / max(self.processes, 1) / 2**20:.0f} MiB per process before any device)")


def host_devices(config: RunConfig, indices: Sequence[int], *, start_timeout: float,
                 on_joined: Callable[[Footprint], None] | None = None) -> Footprint:
    """Host devices `indices` of the run `config` describes until it finishes: check the run's
    settings against the coordinator's, start the worker processes, report the footprint once
    the devices joined (`on_joined`) and wait for the workers to end. Raises `RunNotAnnounced`,
    `ConfigError` (settings differ) or `DevicesFailed` (some devices failed or never joined)."""
    url = config.broker.broker
    if url is None:
        raise ConfigError("--broker is required: the broker the coordinator's host runs, as this host reaches it")
    indices = tuple(indices)
    check_settings(config, announced_settings(config, url, client_id_for(indices[0]), start_timeout))
    log.info("hosting devices %s of run on federation %s", describe_indices(indices), config.broker.federation)
    done = threading.Event()
    with sigint_blocked():  # the workers start deaf to Ctrl-C: stopping them is this process's job
        pool = WorkerPool(config, indices, url)
    try:
        watch = pool.watch(done)
        reports = pool.hosted(start_timeout)
        if reports is None:
            raise DevicesFailed(f"the devices did not all join within {start_timeout:.0f} s: is the coordinator of "
                                f"federation {config.broker.federation} still running?")
        footprint = Footprint.of(reports)
        if on_joined is not None:
            on_joined(footprint)
        # the watch alone reaps the workers: a join here could reap a killed one first, and the
        # watch would then read no exit code and report no death
        watch.join()
        failures = [f"{cause} ({', '.join(names)})" for cause, names in watch.causes.items()]
        failures += [f"{error} ({name})" for name, error in pool.partial_failures().items()]
        if failures:
            raise DevicesFailed(f"devices failed: {'; '.join(failures)}")
        return footprint
    finally:
        done.set()
        pool.stop()
