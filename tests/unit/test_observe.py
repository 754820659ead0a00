"""Unit tests for coordinator/observe: the Prometheus exporter fed synthetic events, the HTTP
server's token and routes, and the `[observe]` settings."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from coordinator.events import (DeviceOffline, DeviceOnline, DevicesRegistered, EventBus, ReleaseServed, RoundEnded,
                                RoundEvaluated, RoundStarted, RunStarted)
from edge_sdk.channel import ChannelSnapshot
from edge_sdk.config import ConfigError

pytest.importorskip("prometheus_client")


def _samples(registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `registry`, parsed back from the text format: (name, sorted labels) -> value."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _round_ended(round_: int, *, seconds: float, privacy: dict | None = None) -> RoundEnded:
    record = {"round": round_, "selected": 3, "participants": 2, "seconds": seconds, "bytes_up": 3000,
              "bytes_down": 1000, "personalized_accuracy": {"mean": 0.5}, "global_accuracy": None,
              "privacy": privacy}
    channel = ChannelSnapshot(messages={"sent": {"train": 1, "evaluate": 1}, "received": {"train_res": 2}},
                              bytes={"sent": {"train": 700, "evaluate": 300}, "received": {"train_res": 3000}},
                              rejections={"non_finite": 1}, duplicates=0, send_seconds=0.0, accept_seconds=0.0,
                              peak_pending_blobs=0, peak_pending_bytes=0)
    return RoundEnded(round_, record, channel)


def _fed_exporter(events, *, private: bool = False):
    from prometheus_client import CollectorRegistry

    from coordinator.observe.prometheus import PrometheusExporter

    registry = CollectorRegistry()
    bus = EventBus()
    PrometheusExporter(registry, federation="plant7", private=private).attach(bus)
    for event in events:
        bus.emit(event)
    return registry


def test_the_exporter_counts_rounds_traffic_rejections_and_durations_per_federation():
    # Prepare
    events = [RunStarted("run-abc", 0, 5), DevicesRegistered(3, 3, 1.0),
              RoundStarted(1, ("dev0", "dev1", "dev2")), RoundEvaluated(1, 3, 0.75, 0.1), _round_ended(1, seconds=0.7),
              RoundStarted(2, ("dev0", "dev1", "dev2")), _round_ended(2, seconds=45.0)]
    fed = (("federation", "plant7"),)

    # Execute
    samples = _samples(_fed_exporter(events))

    # Assert
    assert samples[("edgepfl_rounds_completed_total", fed)] == 2
    assert samples[("edgepfl_round", fed)] == 2 and samples[("edgepfl_rounds_planned", fed)] == 5
    assert samples[("edgepfl_run_info", (*fed, ("run_id", "run-abc")))] == 1
    assert samples[("edgepfl_round_participants", fed)] == 2 and samples[("edgepfl_round_selected", fed)] == 3
    up = (("direction", "up"), ("federation", "plant7"), ("kind", "train_res"))
    down = (("direction", "down"), ("federation", "plant7"), ("kind", "train"))
    assert samples[("edgepfl_bytes_total", up)] == 6000 and samples[("edgepfl_bytes_total", down)] == 1400
    assert samples[("edgepfl_messages_total", up)] == 4
    assert samples[("edgepfl_rejections_total", (*fed, ("reason", "non_finite")))] == 2
    assert samples[("edgepfl_rejections_total", (*fed, ("reason", "stale")))] == 0  # every reason from 0
    assert samples[("edgepfl_round_duration_seconds_count", fed)] == 2
    assert samples[("edgepfl_round_duration_seconds_sum", fed)] == pytest.approx(45.7)
    assert samples[("edgepfl_round_duration_seconds_bucket", (*fed, ("le", "1.0")))] == 1
    assert samples[("edgepfl_round_duration_seconds_bucket", (*fed, ("le", "60.0")))] == 2
    assert samples[("edgepfl_accuracy", fed)] == 0.75
    assert samples[("edgepfl_devices_registered", fed)] == 3
    assert ("edgepfl_epsilon", fed) not in samples  # no DP: no epsilon series


def test_the_exporter_follows_devices_online_epsilon_and_releases_served():
    # Prepare
    events = [DeviceOnline("dev0", "trainer", 1, 1), DeviceOnline("dev1", "lite", 2, 2), DeviceOffline("dev0", 1),
              _round_ended(1, seconds=1.0, privacy={"epsilon": 1.25, "delta": 1e-5}),
              ReleaseServed("dev1", "ab" * 32, 1234), ReleaseServed("dev1", "ab" * 32, 1234)]
    fed = (("federation", "plant7"),)

    # Execute
    samples = _samples(_fed_exporter(events))

    # Assert
    assert samples[("edgepfl_devices_online", fed)] == 1
    assert samples[("edgepfl_devices_registered", fed)] == 2
    assert samples[("edgepfl_epsilon", fed)] == 1.25
    assert samples[("edgepfl_releases_served_total", fed)] == 2


def test_under_dp_the_exporter_publishes_no_round_s_devices_uploads_or_rejections():
    # Prepare
    events = [RunStarted("run-abc", 0, 5), DevicesRegistered(3, 3, 1.0), RoundStarted(1, ("dev0", "dev1", "dev2")),
              RoundEvaluated(1, 3, 0.75, 0.1), _round_ended(1, seconds=0.7, privacy={"epsilon": 0.5})]
    fed = (("federation", "plant7"),)

    # Execute
    samples = _samples(_fed_exporter(events, private=True))

    # Assert: progress, the released accuracy, the epsilon and the downstream traffic remain
    names = {name for name, _ in samples}
    assert not names & {"edgepfl_round_selected", "edgepfl_round_participants", "edgepfl_rejections_total"}
    assert not [labels for name, labels in samples if ("direction", "up") in labels]
    assert samples[("edgepfl_round", fed)] == 1 and samples[("edgepfl_accuracy", fed)] == 0.75
    assert samples[("edgepfl_epsilon", fed)] == 0.5
    assert samples[("edgepfl_bytes_total", (("direction", "down"), *fed, ("kind", "train")))] == 700


def test_two_exporters_keep_their_own_registries():
    # Execute: the global registry would refuse the second set of names
    first = _fed_exporter([_round_ended(1, seconds=1.0)])
    second = _fed_exporter([])

    # Assert
    assert _samples(first)[("edgepfl_rounds_completed_total", (("federation", "plant7"),))] == 1
    assert _samples(second)[("edgepfl_rounds_completed_total", (("federation", "plant7"),))] == 0


# -- the HTTP server -----------------------------------------------------------------------


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.fixture
def metrics_server():
    from coordinator.observe.http import ObserveServer, Response

    def serve(token: str | None = None) -> ObserveServer:
        server = ObserveServer("127.0.0.1", 0, token=token)
        server.route("/metrics", lambda request: Response(b"edgepfl_up 1\n"))
        server.start()
        servers.append(server)
        return server

    servers: list = []
    yield serve
    for server in servers:
        server.stop()


def test_with_a_token_the_server_answers_401_without_it_and_200_with_it(metrics_server):
    server = metrics_server(token="s3cret")

    assert _get(f"{server.url}/metrics")[0] == 401
    assert _get(f"{server.url}/metrics", {"Authorization": "Bearer wrong"})[0] == 401
    assert _get(f"{server.url}/metrics?token=wrong")[0] == 401
    assert _get(f"{server.url}/metrics", {"Authorization": "Bearer s3cret"}) == (200, b"edgepfl_up 1\n")
    assert _get(f"{server.url}/metrics?token=s3cret") == (200, b"edgepfl_up 1\n")
    assert _get(f"{server.url}/nothing", {"Authorization": "Bearer s3cret"})[0] == 404


def test_without_a_token_the_server_answers_its_routes_and_404_elsewhere(metrics_server):
    server = metrics_server()

    assert _get(f"{server.url}/metrics") == (200, b"edgepfl_up 1\n")
    assert _get(f"{server.url}/")[0] == 404
    assert _get(f"{server.url}/metrics/extra")[0] == 404


def test_a_route_added_later_is_served_with_its_content_type(metrics_server):
    # Prepare
    from coordinator.observe.http import Response

    server = metrics_server()

    # Execute
    server.route("/state", lambda request: Response(b'{"round": 2}', "application/json"))

    # Assert
    with urllib.request.urlopen(f"{server.url}/state", timeout=10) as response:
        assert (response.status, response.headers["Content-Type"], response.read()) == (
            200, "application/json", b'{"round": 2}')


def test_the_metrics_server_of_a_run_binds_loopback_when_given_a_port_and_serves_the_exporter(tmp_path):
    # Prepare
    from coordinator.config.run_config import RunConfig
    from coordinator.observe.session import observing

    config = RunConfig.of(http="0", out=str(tmp_path), federation="plant7")

    # Execute
    with observing(config) as observation:
        server = observation.server
        assert server is not None
        observation.on_event(_round_ended(1, seconds=2.0))
        status, body = _get(f"http://127.0.0.1:{server.port}/metrics")

    # Assert
    assert server.host == "127.0.0.1"
    assert status == 200 and b'edgepfl_rounds_completed_total{federation="plant7"} 1.0' in body
    with pytest.raises(OSError):  # stopped with the run
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=2)


# -- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize("value, address", [("9100", ("127.0.0.1", 9100)), (":9100", ("127.0.0.1", 9100)),
                                            ("0.0.0.0:9100", ("0.0.0.0", 9100)), ("[::1]:9100", ("::1", 9100))])
def test_http_takes_a_port_or_host_and_port(value, address):
    from coordinator.observe.settings import http_address

    assert http_address(value) == address


def test_a_non_loopback_http_without_a_token_is_refused_naming_http_token():
    from coordinator.config.run_config import build_config

    with pytest.raises(ConfigError, match="^http_token must be set when http binds 0.0.0.0"):
        build_config(None, {"http": "0.0.0.0:9100"}, {})
    with pytest.raises(ConfigError, match="^http_token"):
        build_config(None, {"http": "metrics.example.org:9100"}, {})
    assert build_config(None, {"http": "0.0.0.0:9100", "http_token": "t"}, {}).observe.http_token == "t"
    assert build_config(None, {"http": "localhost:9100"}, {}).observe.http == "localhost:9100"


def test_bad_http_and_track_values_are_refused_naming_their_key():
    from coordinator.config.run_config import build_config

    with pytest.raises(ConfigError, match="^http must be HOST:PORT"):
        build_config(None, {"http": "127.0.0.1:http"}, {})
    with pytest.raises(ConfigError, match="^track must be none, tensorboard or mlflow"):
        build_config(None, {"track": "wandb"}, {})


def test_the_token_never_reaches_the_run_files_and_trackers_default_under_the_run_folder(tmp_path):
    from coordinator.config.run_config import RunConfig

    config = RunConfig.of(http="9100", http_token="s3cret", track="mlflow", out=str(tmp_path / "run"))

    assert "http_token" not in config.to_flat() and config.to_flat()["http"] == "9100"
    assert config.observe.tracking_location(config.run.out) == (tmp_path / "run" / "mlruns").resolve().as_uri()
    assert config.replace(track="tensorboard").observe.tracking_location("runs/a") == "runs/a/tensorboard"


def test_a_port_taken_is_a_config_error_naming_http(tmp_path):
    from coordinator.config.run_config import RunConfig
    from coordinator.observe.http import ObserveServer
    from coordinator.observe.session import observing

    with ObserveServer("127.0.0.1", 0) as taken:
        config = RunConfig.of(http=f"127.0.0.1:{taken.port}", out=str(tmp_path))
        with pytest.raises(ConfigError, match=f"^http 127.0.0.1:{taken.port}: cannot listen there"):
            with observing(config):
                pass


def test_a_missing_observe_library_names_the_extra():
    from coordinator.extras import missing_extra

    for module in ("prometheus_client", "mlflow", "tensorboard"):
        exc = ModuleNotFoundError(f"No module named '{module}'", name=module)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("importlib.util.find_spec", lambda name: None)
            line = str(missing_extra(exc, "coordinator"))
        assert line.endswith('pip install "edgepfl[observe]"'), line


def test_an_observer_that_fails_is_dropped_and_the_run_goes_on(tmp_path, caplog):
    # Prepare
    from coordinator.config.run_config import RunConfig
    from coordinator.observe.session import observing

    class Broken:
        def on_event(self, event):
            raise ConnectionError("tracking server gone")

    seen: list = []
    with observing(RunConfig.of(out=str(tmp_path))) as observation:
        observation.observers.extend([Broken().on_event, seen.append])

        # Execute
        observation.on_event(RunStarted("r", 0, 2))
        observation.on_event(RunStarted("r", 1, 2))

    # Assert
    assert [e.after_round for e in seen] == [0, 1]
    assert observation.observers == [seen.append]
    assert "Broken failed on RunStarted (tracking server gone); it observes no more" in caplog.text
