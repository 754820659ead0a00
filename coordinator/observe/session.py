"""What `[observe]` turns on for one run of the coordinator or simulate command.

`observing(config)` is a context manager around the run: on entry it makes the Prometheus
exporter and the live view's state and starts the HTTP server (`http`: `/metrics`, the page at
`/`, `/state.json`), and makes the tracker (`track`); the command feeds
`Observation.on_event` every event of its coordinator; on exit the trackers log the run's final
artifacts and the server stops, whether the run finished or failed. A failing observer is logged,
never fatal to the run. With everything off, nothing is imported and nothing is started.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from edge_sdk.config import ConfigError

from ..run.folder import RunFolder
from .settings import http_address

if TYPE_CHECKING:
    from ..config.run_config import RunConfig
    from .http import ObserveServer
    from .tracking import MlflowTracker, TensorBoardTracker

log = logging.getLogger(__name__)


class Observation:
    """The observers of one run: each gets every event (`on_event`); `finish` ends the trackers.
    Watching never stops the run: an observer that fails (a tracking server gone) is logged
    and dropped."""

    def __init__(self, folder: RunFolder) -> None:
        self.folder = folder
        self.observers: list[Callable[[Any], None]] = []
        self.trackers: list[TensorBoardTracker | MlflowTracker] = []
        self.server: ObserveServer | None = None

    def on_event(self, event: Any) -> None:
        """Hand a coordinator event to every observer."""
        for observe in list(self.observers):
            try:
                observe(event)
            except Exception as exc:
                log.warning("%s failed on %s (%s); it observes no more of this run", _owner(observe),
                            type(event).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
                self.observers.remove(observe)

    def finish(self, *, failed: bool) -> None:
        """End every tracker (one that fails is logged)."""
        for tracker in self.trackers:
            try:
                tracker.finish(self.folder, failed=failed)
            except Exception as exc:
                log.warning("%s could not log the run's end (%s)", type(tracker).__name__, exc,
                            exc_info=log.isEnabledFor(logging.DEBUG))


def _owner(callback: Callable[[Any], None]) -> str:
    """The name of the observer a bound method belongs to."""
    return type(getattr(callback, "__self__", callback)).__name__


def experiment_name(config: RunConfig) -> str:
    """The MLflow experiment of a run: its federation's."""
    return f"edgepfl-{config.broker.federation}"


@contextmanager
def observing(config: RunConfig) -> Iterator[Observation]:
    """Start what `config.observe` asks for, yield the `Observation` to feed, stop it all on exit."""
    settings = config.observe
    observation = Observation(RunFolder(config.run.out))
    if settings.http is not None:
        observation.server = _metrics_server(config, observation)
    if settings.track != "none":
        tracker = _tracker(config)
        observation.trackers.append(tracker)
        observation.observers.append(tracker.on_event)
    failed = True
    try:
        if observation.server is not None:
            _listen(observation.server)
        yield observation
        failed = False
    finally:
        try:
            observation.finish(failed=failed)
        finally:
            if observation.server is not None:
                observation.server.stop()


def _metrics_server(config: RunConfig, observation: Observation) -> ObserveServer:
    """The HTTP server with `/metrics` of a new exporter and the live view (`/`, `/state.json`) of
    a new `LiveState`, both fed the run's events."""
    from prometheus_client import CollectorRegistry

    from .http import ObserveServer
    from .live import LiveState
    from .prometheus import PrometheusExporter
    from .view import add_view_routes

    private = config.privacy.enabled  # under DP neither publishes a device's counts
    exporter = PrometheusExporter(CollectorRegistry(), federation=config.broker.federation, private=private)
    live = LiveState({"algorithm": config.run.algorithm, "dataset": config.run.dataset, "model": config.model_name,
                      "federation": config.broker.federation}, folder=observation.folder, private=private)
    observation.observers += [exporter.on_event, live.on_event]
    host, port = http_address(str(config.observe.http))
    server = ObserveServer(host, port, token=config.observe.http_token)
    server.route("/metrics", exporter.route)
    add_view_routes(server, lambda: live)
    return server


def _listen(server: ObserveServer) -> None:
    """Start `server`; a port it cannot bind is a bad `http` (a ConfigError naming it)."""
    try:
        server.start()
        log.info("live view at %s/ (the token, if any, as ?token=)", server.url)
    except OSError as exc:
        raise ConfigError(f"http {server.host}:{server.requested_port}: cannot listen there ({exc.strerror or exc})") \
            from None


def _tracker(config: RunConfig) -> TensorBoardTracker | MlflowTracker:
    """The tracker `track` names, writing where `track_uri` says (or under the run folder)."""
    settings = config.to_flat()  # secrets left out
    location = config.observe.tracking_location(config.run.out)
    if config.observe.track == "tensorboard":
        from .tracking import TensorBoardTracker

        log.info("TensorBoard logs in %s", location)
        return TensorBoardTracker(location, settings=settings)
    from .tracking import MlflowTracker

    log.info("MLflow tracking at %s, experiment %s", location, experiment_name(config))
    return MlflowTracker(location, experiment_name(config), settings=settings)
