"""The live view in a real browser: headless Chromium opens the page while a federation plays over
Mosquitto, and after it through `edgepfl view RUN_DIR`.

Chromium runs the page's script (`--virtual-time-budget`) and dumps the DOM; the page puts what
it shows into data attributes (a row per device, a chart per figure with its rounds), which are
checked against the run's report.json. A screenshot of each page is left in the test's tmp dir.
In CI (CI=true) a missing `chromium` is a failure, elsewhere a skip, as for Mosquitto.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from harness.brokers import require_binary
from observed_runs import nan_fleet

pytestmark = pytest.mark.integration

TOKEN = "watch-me"
ROUNDS = 3
CHARTS = ("accuracy", "traffic", "participants")


class ShownPage(HTMLParser):
    """The data attributes of the page's device rows, charts and body."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.devices: dict[str, dict[str, str]] = {}
        self.charts: dict[str, dict[str, str]] = {}
        self.body: dict[str, str] = {}
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {key: value or "" for key, value in attrs}
        if tag == "tr" and "data-device" in values:
            self.devices[values["data-device"]] = values
        elif tag == "svg" and "data-chart" in values:
            self.charts[values["data-chart"]] = values
        elif tag == "body":
            self.body = values


class Chromium:
    """Headless Chromium runs a page's script for a few (virtual) seconds, then dumps or shoots it."""

    def __init__(self, workdir: Path) -> None:
        self.binary = require_binary("chromium", shutil.which("chromium"))
        self.workdir = workdir

    def _run(self, url: str, *what: str) -> str:
        done = subprocess.run([self.binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               f"--user-data-dir={self.workdir / 'profile'}", "--virtual-time-budget=3000",
                               "--window-size=1400,1000", *what, url], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    def page(self, url: str) -> ShownPage:
        return ShownPage(self._run(url, "--dump-dom"))

    def screenshot(self, url: str, path: Path) -> None:
        self._run(url, f"--screenshot={path}")
        assert path.stat().st_size > 10_000  # an image, not an empty page


def _assert_shows_the_report(shown: ShownPage, report: dict, *, live: bool) -> None:
    """Every device of the report with its kind, final accuracy and state; every round charted."""
    rounds = ",".join(str(r["round"]) for r in report["rounds"])
    assert {name: shown.charts[name]["data-rounds"] for name in CHARTS} == dict.fromkeys(CHARTS, rounds)
    assert all(shown.charts[name]["data-points"] == str(len(report["rounds"])) for name in CHARTS)
    per_client = report["final"]["per_client"]
    assert sorted(shown.devices) == sorted(per_client)
    for device, final in per_client.items():
        row = shown.devices[device]
        assert (row["data-kind"], row["data-state"]) == (final["kind"], "online"), device
        assert float(row["data-accuracy"]) == pytest.approx(final["accuracy"]), device
    if live:  # who took part, device by device, adds up to the rounds' counts
        for what in ("selected", "replied", "late", "missing", "refused"):
            total = sum(int(row[f"data-{what}"]) for row in shown.devices.values())
            assert total == sum(r["replied" if what == "replied" else what] for r in report["rounds"]), what
    assert shown.body["data-round"] == str(report["rounds_completed"]) == str(ROUNDS)


def test_the_page_shows_a_run_while_it_goes_and_after_it(mosquitto, tmp_path):
    # Prepare: a coordinator serving the live view, three devices (dev2 uploads NaNs: refused)
    from coordinator.config.run_config import RunConfig
    from coordinator.events import RoundEnded
    from coordinator.observe.session import observing
    from coordinator.server import Coordinator
    from edge_sdk.channel import Channel
    from edge_sdk.protocol import Topics

    chromium = Chromium(tmp_path)
    federation = "liveview"
    out = tmp_path / "run"
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=3, rounds=ROUNDS, local_epochs=1,
                          batch_size=64, out=str(out), federation=federation, round_timeout=60,
                          registration_timeout=60, http="127.0.0.1:0", http_token=TOKEN)
    threads, stop, transport = nan_fleet(mosquitto.url, federation, tmp_path)
    mid_run: list[ShownPage] = []
    try:
        with observing(config) as observation:
            assert observation.server is not None
            url = f"{observation.server.url}/?token={TOKEN}"
            coordinator = Coordinator(config, Channel(transport, Topics(federation)))
            coordinator.subscribe(observation.on_event)

            def look_after_round_1(event: RoundEnded) -> None:  # the coordinator waits while the browser looks
                if event.round == 1:
                    mid_run.append(chromium.page(url))

            coordinator.subscribe(look_after_round_1, RoundEnded)
            for thread in threads:
                thread.start()

            # Execute: the run, then the page as it stands at its end
            report = coordinator.run()
            live = chromium.page(url)
            chromium.screenshot(url, tmp_path / "live.png")
    finally:
        transport.close()
        stop.set()
        for thread in threads:
            thread.join(timeout=30)

    # Assert: after round 1 the page showed round 1 of 3, the devices and a point per chart
    assert mid_run[0].body["data-round"] == "1" and mid_run[0].body["data-rounds"] == str(ROUNDS)
    assert sorted(mid_run[0].devices) == ["dev0", "dev1", "dev2"]
    assert all(mid_run[0].charts[name]["data-rounds"] == "1" for name in CHARTS)

    # Assert: at the end, the report's devices, states and rounds; dev2 refused every round
    _assert_shows_the_report(live, report, live=True)
    assert live.devices["dev2"]["data-refused"] == str(ROUNDS) and live.devices["dev0"]["data-replied"] == str(ROUNDS)
    assert live.devices["dev2"]["data-rejections"] == f"non_finite:{ROUNDS}"
    assert live.devices["dev0"]["data-rejections"] == ""

    # Execute: `edgepfl view` over the finished run's folder
    view = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "view", str(out), "--http", "127.0.0.1:0",
                             "--http-token", TOKEN], stdout=subprocess.PIPE, text=True)
    try:
        assert view.stdout is not None
        announced = view.stdout.readline()
        url = announced.split(" at ")[1].split(" ")[0]
        after = chromium.page(url)
        chromium.screenshot(url, tmp_path / "view.png")
    finally:
        view.terminate()
        view.wait(timeout=20)

    # Assert: the folder's view shows the same devices and rounds
    assert url.endswith(f"/?token={TOKEN}")
    _assert_shows_the_report(after, json.loads((out / "report.json").read_text()), live=False)
    assert after.body["data-source"] == "folder" and after.body["data-status"] == "finished"
