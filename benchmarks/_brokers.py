"""Shared helpers of the systems benchmarks (transport, scale, overhead): brokers and machine info.

Not a benchmark itself: a module of the benchmarks package (the scripts run as
`python -m benchmarks.<name>`); nothing in edge_sdk, coordinator or export imports it.

- `mosquitto(workdir)`: harness.brokers' Mosquitto (the tests' own) on a free loopback port with
  a config written here (the lines every benchmark needs plus any `extra` ones), as a context
  manager; a RuntimeError naming `--broker` when Mosquitto is not installed.
- `broker(kind, workdir)`: "mosquitto" (the above), "amqtt" (`coordinator.brokers.embedded.EmbeddedBroker`)
  or an external `mqtt://host:port` URL; yields `(url, mqtt_protocol)`.
- `machine_info()`: what the JSON results record about the machine, without the hostname.
- `raise_fd_limit()`: lift the soft RLIMIT_NOFILE to the hard limit (children inherit it).
"""

from __future__ import annotations

import contextlib
import resource
import subprocess
from pathlib import Path
from typing import NamedTuple
from collections.abc import Iterator

from . import _machine
from coordinator.brokers.embedded import EmbeddedBroker
from harness.brokers import Mosquitto, mosquitto_binary


def mosquitto_version() -> str | None:
    binary = mosquitto_binary()
    if binary is None:
        return None
    try:
        out = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = (out.stdout or out.stderr).splitlines()
    return first[0].strip() if first else None


def mosquitto(workdir: Path, extra: str = "", port: int | None = None) -> Mosquitto:
    """harness.brokers' Mosquitto (a free loopback port, a config written here with `extra` lines
    appended; a context manager), or a RuntimeError naming the alternative when it is not installed."""
    binary = mosquitto_binary()
    if binary is None:
        raise RuntimeError("mosquitto is not installed (apt-get install mosquitto), or pass --broker mqtt://host:port")
    return Mosquitto(Path(workdir), extra=extra, port=port, binary=binary)


class RunningBroker(NamedTuple):
    url: str
    protocol: str  # the MqttSettings.protocol to use with it
    pid: int | None  # the broker's process, when started here


@contextlib.contextmanager
def broker(kind: str, workdir: Path, *, mosquitto_extra: str = "") -> Iterator[RunningBroker]:
    """A running broker: "mosquitto", "amqtt" (both started here) or an external mqtt:// URL."""
    if kind == "mosquitto":
        with mosquitto(workdir / "mosquitto", extra=mosquitto_extra) as started:
            yield RunningBroker(started.url, "auto", started.process.pid if started.process else None)
    elif kind == "amqtt":
        with EmbeddedBroker() as started:
            yield RunningBroker(started.url, "3.1.1", None)  # amqtt speaks MQTT 3.1.1 only
    elif "://" in kind:
        yield RunningBroker(kind, "auto", None)
    else:
        raise ValueError(f"unknown broker {kind!r}: mosquitto, amqtt or mqtt://host:port")


def raise_fd_limit() -> tuple[int, int]:
    """Lift the soft open-files limit to the hard one; returns the (soft, hard) now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def machine_info() -> dict:
    """`_machine.machine_info` with the MQTT stack's versions."""
    return {**_machine.machine_info(("torch", "onnxruntime", "numpy", "msgpack", "paho-mqtt", "amqtt")),
            "mosquitto": mosquitto_version()}
