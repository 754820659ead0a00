"""A real Prometheus scrapes a run's `--http` endpoint while a federation plays over Mosquitto.

Debian's `prometheus` binary scrapes `/metrics` every second with the run's bearer token; the
test polls Prometheus' query API until the series hold the run's own figures (rounds, bytes by
direction, rejections, the round duration histogram). In CI (CI=true) a missing binary is a
failure, elsewhere a skip, as for Mosquitto (harness/brokers.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from harness.brokers import require_binary
from observed_runs import nan_fleet
from coordinator.brokers.embedded import free_port

pytestmark = pytest.mark.integration

TOKEN = "scrape-me"
DEADLINE = 45.0  # seconds Prometheus may take to start, or to see a figure


DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-edgepfl.json"


def _dashboard_queries(federation: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of docs/grafana-edgepfl.json, its variables filled in."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(panel["title"], target["expr"].replace("$federation", federation).replace("$__rate_interval", "1m"))
            for panel in panels for target in panel["targets"]]


def require_prometheus() -> str:
    return require_binary("prometheus", shutil.which("prometheus")
                          or shutil.which("prometheus", path="/usr/bin:/usr/sbin:/usr/local/bin"))


class Prometheus:
    """A Prometheus process on a free loopback port scraping `target` every second with `TOKEN`."""

    def __init__(self, workdir: Path, target: str):
        self.binary = require_prometheus()
        self.port = free_port()
        self.workdir = workdir
        self.config = workdir / "prometheus.yml"
        self.config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: edgepfl\n"
            f"    authorization:\n      credentials: {TOKEN}\n"
            f"    static_configs:\n      - targets: ['{target}']\n")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        log = open(self.workdir / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.poll(lambda: self._get("/-/ready") == 200, "Prometheus to be ready")
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def query(self, expression: str) -> dict[tuple[tuple[str, str], ...], float]:
        """The instant vector of `expression`: labels (sorted; name, job and instance left out) -> value."""
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expression})}",
                                    timeout=10) as response:
            result = json.loads(response.read())["data"]["result"]
        return {tuple(sorted((k, v) for k, v in item["metric"].items() if k not in ("__name__", "job", "instance"))):
                float(item["value"][1]) for item in result}

    def poll(self, ready, what: str):
        """Call `ready()` until it returns a true value (which is returned) or DEADLINE passes."""
        if self.process is None:
            raise AssertionError("prometheus was not started")
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            value = ready()
            if value:
                return value
            try:  # between two polls, wait on prometheus itself: its exit ends the wait at once
                self.process.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            raise AssertionError(f"prometheus exited; see {self.workdir / 'prometheus.log'}")
        raise AssertionError(f"timed out waiting for {what}")

    def poll_query(self, expression: str, expected: dict) -> None:
        """Poll until `expression` gives `expected`; a mismatch at the deadline is shown."""
        seen: list = []

        def matches() -> bool:
            seen[:] = [self.query(expression)]
            return seen[0] == expected

        try:
            self.poll(matches, expression)
        except AssertionError:
            assert seen and seen[0] == expected, expression
            raise

    def _get(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as response:
                return response.status
        except (urllib.error.URLError, ConnectionError):
            return None


@pytest.fixture
def prometheus_for(tmp_path):
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        workdir = tmp_path / "prometheus"
        workdir.mkdir()
        started.append(Prometheus(workdir, target).start())
        return started[-1]

    yield start
    for prometheus in started:
        prometheus.stop()


def test_prometheus_scrapes_the_runs_rounds_traffic_rejections_and_durations(mosquitto, prometheus_for, tmp_path):
    # Prepare: a coordinator whose /metrics Prometheus scrapes, three devices (one uploads NaNs)
    from coordinator.config.run_config import RunConfig
    from coordinator.events import RoundEnded
    from coordinator.observe.session import observing
    from coordinator.server import Coordinator
    from edge_sdk.channel import Channel
    from edge_sdk.protocol import Topics

    federation = "promtest"
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=3, rounds=2, local_epochs=1, batch_size=64,
                          out=str(tmp_path / "run"), federation=federation, round_timeout=60,
                          registration_timeout=60, http="127.0.0.1:0", http_token=TOKEN)
    threads, stop, transport = nan_fleet(mosquitto.url, federation, tmp_path)
    ended: list = []
    try:
        with observing(config) as observation:
            assert observation.server is not None
            prometheus = prometheus_for(f"127.0.0.1:{observation.server.port}")
            coordinator = Coordinator(config, Channel(transport, Topics(federation)))
            coordinator.subscribe(observation.on_event)
            coordinator.subscribe(ended.append, RoundEnded)
            for thread in threads:
                thread.start()

            # Execute
            report = coordinator.run()

            # Assert: what Prometheus scraped is what the run did
            fed = (("federation", federation),)
            prometheus.poll_query("edgepfl_rounds_completed_total", {fed: 2.0})
            up = Counter[str]()
            down = Counter[str]()
            rejected = Counter[str]()
            for event in ended:
                up.update(event.channel.bytes["received"])
                down.update(event.channel.bytes["sent"])
                rejected.update(event.channel.rejections)
            prometheus.poll_query("sum by (federation, direction) (edgepfl_bytes_total)",
                                  {(("direction", "down"), *fed): float(sum(down.values())),
                                   (("direction", "up"), *fed): float(sum(up.values()))})
            assert up["train_res"] > 0 and down["train"] > 0
            assert rejected["non_finite"] >= 2  # the NaN device's update, both rounds
            prometheus.poll_query("edgepfl_rejections_total > 0",
                                  {(*fed, ("reason", reason)): float(n) for reason, n in rejected.items()})
            prometheus.poll_query("edgepfl_round_duration_seconds_count", {fed: 2.0})
            durations = prometheus.query("edgepfl_round_duration_seconds_sum")[fed]
            assert durations == pytest.approx(sum(r["seconds"] for r in report["rounds"]))
            assert prometheus.query('edgepfl_round_duration_seconds_bucket{le="+Inf"}') == {
                (*fed, ("le", "+Inf")): 2.0}
            prometheus.poll_query("edgepfl_round_participants", {fed: 2.0})
            prometheus.poll_query("edgepfl_devices_online", {fed: 3.0})
            prometheus.poll_query("edgepfl_accuracy", {fed: report["rounds"][-1]["personalized_accuracy"]["mean"]})
            assert prometheus.query("edgepfl_run_info") == {(*fed, ("run_id", report["run_id"])): 1.0}
            for title, expression in _dashboard_queries(federation):  # Prometheus answers 400 to bad PromQL
                assert isinstance(prometheus.query(expression), dict), title
    finally:
        transport.close()
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
