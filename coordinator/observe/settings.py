"""The `[observe]` settings section: how an operator watches a run while it goes.

A Prometheus endpoint (`http`, guarded by `http_token` off the loopback interface) and an
experiment tracker (`track`: TensorBoard or MLflow) are off by default; the coordinator and
simulate commands take them. Only the standard library is imported, so `edgepfl --help` stays
instant.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from edge_sdk.settings import RUN_COMMANDS, check, setting

TRACKERS = ("none", "tensorboard", "mlflow")
LOOPBACK_HOST = "127.0.0.1"
"""Where `http` binds when it gives only a port."""


def http_address(value: str) -> tuple[str, int]:
    """(host, port) of an `http` value: HOST:PORT, [IPv6]:PORT, :PORT or PORT (then on the
    loopback interface); a ValueError naming `http` when it is none of these."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or LOOPBACK_HOST
    check(port.isdigit() and int(port) <= 65535 and " " not in host, "http",
          "HOST:PORT or PORT (port 0 to 65535; 0 picks a free one)", value)
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` names the loopback interface only (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


@dataclass(frozen=True)
class ObserveSettings:
    """What an operator sees of a run while it goes: a Prometheus endpoint and an experiment tracker
    (`[observe]`)."""

    commands: ClassVar[tuple[str, ...]] = RUN_COMMANDS

    http: str | None = setting(None, shown_default="off",
                               help="HOST:PORT (or PORT, on 127.0.0.1) where the coordinator serves the live view "
                                    "(/) and /metrics in the Prometheus text format while the run goes")
    http_token: str | None = setting(None, help="bearer token every --http page requires (header `Authorization: "
                                                "Bearer TOKEN` or ?token=TOKEN); required when --http binds other "
                                                "than a loopback address")
    track: str = setting("none", help="none | tensorboard | mlflow: log each round's figures, the settings and "
                                      "the final report to an experiment tracker")
    track_uri: str | None = setting(None, shown_default="OUT/tensorboard or OUT/mlruns",
                                    help="where --track writes: TensorBoard's log folder, or the MLflow tracking "
                                         "URI (a server, or a file store under the run folder)")

    def __post_init__(self) -> None:
        check(self.track in TRACKERS, "track", "none, tensorboard or mlflow", self.track)
        if self.http is not None:
            host, _ = http_address(self.http)
            check(is_loopback(host) or bool(self.http_token), "http_token",
                  f"set when http binds {host}, which is not a loopback address (anyone who reaches it could "
                  "read the run's metrics)", self.http_token)

    def tracking_location(self, out: str) -> str:
        """`track_uri`, or its default under the run folder `out`: `OUT/tensorboard` for
        TensorBoard, the file store `OUT/mlruns` (as a file: URI) for MLflow."""
        if self.track_uri:
            return self.track_uri
        if self.track == "mlflow":
            return (Path(out) / "mlruns").resolve().as_uri()
        return str(Path(out) / "tensorboard")
