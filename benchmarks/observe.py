"""The live view's cost and delay: round time with and without `--http`, and event-to-screen delay.

    python -m benchmarks.observe --out benchmarks/results

Quick (a smoke test, well under a minute): `python -m benchmarks.observe --quick --out DIR`
(4 devices, 2 rounds, one repetition of each arm; the page over 8 devices, 2 of them refusing).

Two parts, each `edgepfl simulate` (`python -m coordinator.cli simulate`, a process of its own)
over a Mosquitto started here (or `--broker`), FedAvg on digits, `--workers` device processes:

- **Cost** (`--clients`, `--rounds`, `--local-epochs`): the same run (same seed, data and
  settings) without and with `--http 127.0.0.1:<free port>`, `--repeats` times, the two arms
  alternating (plain first in even repetitions, http first in odd ones) so that a drift of the
  machine's load falls on both. In the http arm a thread of this process fetches the page once
  and then `/state.json` once a second while the run goes, as an open page does. Round time is
  the coordinator's own per-round `seconds` in report.json; the first round of every run (worker
  warm-up) is left out. Per arm: the median over all timed rounds, the interquartile range, each
  run's median; the ratio http / plain of the medians and the paired ratios of each repetition.
  The CPU seconds of each run (the command and its workers) are recorded beside it.
- **Delay** (`--page-clients` devices, `--page-rounds` rounds, `--page-refusing` of them
  uploading NaN, refused each round): headless Chromium (Debian's `chromium`) opens the live page
  as soon as the run's HTTP server listens and is driven over the Chrome DevTools Protocol
  (`websockets`). A script added before the page's own records, for each event row the page
  inserts into its "Latest events" list for the first time, `Date.now()` at insertion and the
  event's own time (the row's `data-time`, the wall clock when the coordinator emitted it). The
  delay is shown - emitted, over the events emitted after the page first showed the run (the
  registrations before that waited for the page, not for a poll). The page polls every
  `POLL_MS` (read from live.js) after the previous poll's render, so a delay is bound by about
  one poll interval plus a fetch and a render; the page's own fetches of /state.json (resource
  timing) give the measured interval and fetch time.

- **Work** (`--clients` devices, `--rounds` synthetic rounds): the CPU seconds the live view
  adds to a coordinator process, measured in this process with the coordinator's own observers
  (`observing`: the Prometheus exporter and the page's state): per event handled on the round
  loop's thread, and per poll of /state.json and /metrics (client included: an upper bound).
  With the cost part's round time it bounds the slowdown, as if all of that work held up the
  round loop: a figure that the machine's load does not blur, unlike the round times.

Writes observe.json and observe.md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from ._brokers import RunningBroker, broker, machine_info
from .flags import add_output_flags, add_run_flags, run_settings
from .runs import log, setup_logging, write_outputs

from coordinator.brokers.embedded import free_port, wait_for_port
from harness.hosts import stop_process

NAME = "observe"
SETTINGS = ("dataset", "clients", "rounds", "local_epochs", "batch_size", "workers", "seed")
TARGET_RATIO = 1.02
"""The product's goal: a run serving the live view (and polled) at most 2% slower per round."""
POLL_SECONDS = 1.0
"""How often the cost part's client fetches /state.json: as often as the open page does."""
QUICK = {"clients": 4, "rounds": 2, "repeats": 1, "page_clients": 8, "page_rounds": 2, "page_refusing": 2}
FULL = {"clients": 20, "rounds": 20, "repeats": 6, "page_clients": 100, "page_rounds": 10, "page_refusing": 5}
RUN_TIMEOUT = 900.0
"""Seconds one simulate run may take before the benchmark gives up on it."""


def poll_ms() -> int:
    """The page's poll interval, as live.js declares it (`const POLL_MS = N;`)."""
    script = files("coordinator.observe").joinpath("static").joinpath("live.js").read_text(encoding="utf-8")
    found = re.search(r"const POLL_MS = (\d+);", script)
    if found is None:
        raise RuntimeError("coordinator/observe/static/live.js declares no POLL_MS")
    return int(found.group(1))


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- one simulate run ---------------------------------------------------------------------------
def simulate_command(settings: dict[str, Any], out: Path, running: RunningBroker, *, refusing: int = 0,
                     http: str | None = None) -> list[str]:
    """`edgepfl simulate` with `settings` (flag names), every non-refusing device awaited each round
    (quorum and grace as the other benchmarks set them), `refusing` devices uploading NaN."""
    flags = {**settings, "algorithm": "fedavg", "device": "cpu", "out": str(out), "broker": running.url,
             "mqtt_protocol": running.protocol, "federation": f"observe-{uuid.uuid4().hex[:8]}",
             "min_clients": settings["clients"] - refusing,
             "round_timeout": 3600, "quorum_grace": 3600, "registration_timeout": 600, "aggregation_dtype": "float64"}
    if refusing:
        flags.update(adversaries=refusing, attack="nan")
    if http is not None:
        flags["http"] = http
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--quiet"]
    for key, value in flags.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    return command


def finish(process: subprocess.Popen, out: Path, log_path: Path) -> dict[str, Any]:
    """Wait for a simulate process and read its report; a failed run stops the benchmark with its log's tail."""
    try:
        code = process.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise RuntimeError(f"simulate ran past {RUN_TIMEOUT:.0f} s; see {log_path}") from None
    if code != 0:
        raise RuntimeError(f"simulate exited {code}: {log_path.read_text()[-3000:]}")
    return json.loads((out / "report.json").read_text())


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- the cost of serving the view -----------------------------------------------------------------
class StatePoller(threading.Thread):
    """Fetches the page once, then /state.json every POLL_SECONDS until `stop` is set, as the open
    page does; records each fetch's seconds and bytes."""

    def __init__(self, base_url: str, stop: threading.Event) -> None:
        super().__init__(name="state-poller", daemon=True)
        self.base_url = base_url
        self.stop = stop
        self.seconds: list[float] = []
        self.sizes: list[int] = []
        self.failures = 0

    def fetch(self, path: str) -> bytes | None:
        """The body at `path`, or None when the server does not answer (not listening yet, or gone)."""
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=10) as response:
                return response.read()
        except (urllib.error.URLError, OSError):
            return None

    def run(self) -> None:
        while self.fetch("/") is None and not self.stop.wait(0.05):  # until the run's server listens
            pass
        while not self.stop.wait(POLL_SECONDS):
            began = time.perf_counter()
            body = self.fetch("/state.json")
            if body is None:
                self.failures += 1
                continue
            self.seconds.append(time.perf_counter() - began)
            self.sizes.append(len(body))

    def summary(self) -> dict[str, Any]:
        return {"polls": len(self.sizes), "failed_fetches": self.failures,
                "median_fetch_ms": 1000 * statistics.median(self.seconds) if self.seconds else None,
                "max_fetch_ms": 1000 * max(self.seconds) if self.seconds else None,
                "largest_state_bytes": max(self.sizes) if self.sizes else None}


def cost_run(settings: dict[str, Any], arm: str, repeat: int, workdir: Path, running: RunningBroker) -> dict[str, Any]:
    """One run of the cost part: its rounds' seconds, CPU seconds and the machine's load around it."""
    out = workdir / f"cost-{repeat}-{arm}"
    http = f"127.0.0.1:{free_port()}" if arm == "http" else None
    log_path = out.with_suffix(".log")
    load_before, cpu_before, began = load_average(), children_cpu_seconds(), time.monotonic()
    stop = threading.Event()
    poller = StatePoller(f"http://{http}", stop) if http else None
    with log_path.open("w") as log_file:
        process = subprocess.Popen(simulate_command(settings, out, running, http=http), stdout=log_file,
                                   stderr=subprocess.STDOUT)
        if poller is not None:
            poller.start()
        try:
            report = finish(process, out, log_path)
        finally:
            stop.set()
            if poller is not None:
                poller.join()
    seconds = [r["seconds"] for r in report["rounds"]]
    return {"arm": arm, "repeat": repeat, "round_seconds": seconds, "timed": seconds[1:] or seconds,
            "median_round_seconds": statistics.median(seconds[1:] or seconds),
            "cpu_seconds": children_cpu_seconds() - cpu_before, "wall_seconds": time.monotonic() - began,
            "load_before": load_before, "load_after": load_average(),
            "polling": poller.summary() if poller is not None else None}


def cost_part(settings: dict[str, Any], repeats: int, workdir: Path, running: RunningBroker, on_run) -> dict[str, Any]:
    """Both arms `repeats` times, alternating which goes first; `on_run` sees the runs so far."""
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for arm in ("plain", "http") if repeat % 2 == 0 else ("http", "plain"):
            log.info("cost, repetition %d of %d, %s ...", repeat + 1, repeats, arm)
            runs.append(cost_run(settings, arm, repeat, workdir, running))
            log.info("  median round %.3f s, load %s", runs[-1]["median_round_seconds"], runs[-1]["load_after"])
            on_run(runs)
    return summarize_cost(runs)


def summarize_cost(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: median and quartiles over all timed rounds, the runs' medians and CPU seconds; the
    ratio of the medians and each repetition's paired ratio."""
    arms: dict[str, dict[str, Any]] = {}
    for arm in ("plain", "http"):
        mine = [run for run in runs if run["arm"] == arm]
        rounds = [s for run in mine for s in run["timed"]]
        arms[arm] = {"runs": len(mine), "timed_rounds": len(rounds), "median_round_seconds": statistics.median(rounds),
                     "p25_round_seconds": percentile(rounds, 25), "p75_round_seconds": percentile(rounds, 75),
                     "run_medians": [run["median_round_seconds"] for run in mine],
                     "cpu_seconds": [run["cpu_seconds"] for run in mine],
                     "median_cpu_seconds": statistics.median(run["cpu_seconds"] for run in mine)}
    by_repeat = {(run["repeat"], run["arm"]): run["median_round_seconds"] for run in runs}
    paired = [by_repeat[(r, "http")] / by_repeat[(r, "plain")] for r in sorted({run["repeat"] for run in runs})]
    ratio = arms["http"]["median_round_seconds"] / arms["plain"]["median_round_seconds"]
    polls = [run["polling"] for run in runs if run["polling"]]
    return {"arms": arms, "ratio": ratio, "paired_ratios": paired, "median_paired_ratio": statistics.median(paired),
            "cpu_ratio": arms["http"]["median_cpu_seconds"] / arms["plain"]["median_cpu_seconds"],
            "target_ratio": TARGET_RATIO, "met": ratio <= TARGET_RATIO,
            "polls": sum(p["polls"] for p in polls), "failed_fetches": sum(p["failed_fetches"] for p in polls),
            "median_fetch_ms": statistics.median(p["median_fetch_ms"] for p in polls if p["median_fetch_ms"]),
            "runs": runs}


# -- the page in headless Chromium ------------------------------------------------------------------
WATCH_EVENTS = r"""
(() => {
  const watch = { shown: [], live: null };
  const seen = new Set();
  window.__watch = watch;
  performance.setResourceTimingBufferSize(100000);
  const rowsAdded = (mutations) => {
    const now = Date.now();
    for (const mutation of mutations) {
      for (const row of mutation.addedNodes) {
        if (!(row instanceof Element) || row.dataset.time === undefined) continue;
        const what = row.textContent.slice(row.firstChild ? row.firstChild.textContent.length : 0);
        const key = `${row.dataset.time}|${row.dataset.event}|${what}`;
        if (seen.has(key)) continue;
        seen.add(key);
        watch.shown.push({ event: row.dataset.event, time: Number(row.dataset.time), shown: now });
      }
    }
  };
  const statusChanged = () => {
    if (watch.live === null && document.body.dataset.status === "live") watch.live = Date.now();
  };
  document.addEventListener("DOMContentLoaded", () => {
    new MutationObserver(rowsAdded).observe(document.getElementById("events"), { childList: true });
    new MutationObserver(statusChanged).observe(document.body, { attributes: true, attributeFilter: ["data-status"] });
  });
})();
"""
"""Added before the page's own script: records each event row the first time the page inserts it
(its event, its data-time and Date.now()), and when the page first showed the run live."""

READ_WATCH = r"""
JSON.stringify({ ...window.__watch,
  fetches: performance.getEntriesByType("resource").filter((e) => e.name.includes("state.json"))
    .map((e) => ({ start: e.startTime, ms: e.duration, bytes: e.encodedBodySize })) })
"""


class DevTools:
    """A Chrome DevTools Protocol session over one page's websocket: a command waits for its
    answer; the events the browser sends meanwhile are not asked for and are dropped."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self.last_id = 0

    @classmethod
    @asynccontextmanager
    async def connect(cls, url: str) -> AsyncIterator[DevTools]:
        from websockets.asyncio.client import connect

        async with connect(url, max_size=None) as socket:
            yield cls(socket)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.last_id += 1
        await self.socket.send(json.dumps({"id": self.last_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self.socket.recv())
            if message.get("id") == self.last_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})


class Chromium:
    """Headless Chromium with the DevTools Protocol on a port it picks (read from its profile's
    DevToolsActivePort), one blank page, as a foreground tab (timers not throttled)."""

    START_SECONDS = 60.0

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.profile = workdir / "chromium-profile"
        self.log_path = workdir / "chromium.log"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Chromium:
        with self.log_path.open("w") as log_file:
            self.process = subprocess.Popen(
                [self.binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--remote-debugging-port=0", f"--user-data-dir={self.profile}", "--window-size=1400,1000",
                 "--disable-background-timer-throttling", "--disable-renderer-backgrounding", "about:blank"],
                stdout=log_file, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            stop_process(self.process, timeout=20)

    def page_socket(self) -> str:
        """The websocket address of the blank page, once Chromium listens."""
        assert self.process is not None
        active = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.START_SECONDS
        while time.monotonic() < deadline and self.process.poll() is None:
            lines = active.read_text().split() if active.is_file() else []
            if len(lines) >= 2:
                with urllib.request.urlopen(f"http://127.0.0.1:{lines[0]}/json/list", timeout=10) as response:
                    targets = json.loads(response.read())
                pages = [t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"]
                if pages:
                    return pages[0]
            time.sleep(0.1)
        raise RuntimeError(f"chromium did not open its DevTools port; see {self.log_path}")


async def watch_run(page: str, command: list[str], http_port: int, out: Path, log_path: Path) -> dict[str, Any]:
    """Start the run, open its page as soon as it listens, and read what the page recorded once
    the run has ended."""
    async with DevTools.connect(page) as tab:
        await tab.call("Page.enable")
        await tab.call("Page.addScriptToEvaluateOnNewDocument", source=WATCH_EVENTS)
        with log_path.open("w") as log_file:
            process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
            try:
                if not await asyncio.to_thread(wait_for_port, "127.0.0.1", http_port, RUN_TIMEOUT):
                    raise RuntimeError(f"the run never served its page; see {log_path}")
                opened = time.time()
                await tab.call("Page.navigate", url=f"http://127.0.0.1:{http_port}/")
                report = await asyncio.to_thread(finish, process, out, log_path)
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        answer = await tab.call("Runtime.evaluate", expression=READ_WATCH, returnByValue=True)
    return {"report": report, "opened": opened, **json.loads(answer["result"]["value"])}


def delay_part(settings: dict[str, Any], refusing: int, workdir: Path, running: RunningBroker) -> dict[str, Any]:
    """One run with `refusing` NaN uploaders, watched by the page in headless Chromium: the delays
    from each event's emission to its row on the page."""
    binary = shutil.which("chromium")
    if binary is None:
        raise RuntimeError("chromium is not installed (apt-get install chromium)")
    port = free_port()
    out = workdir / "page"
    command = simulate_command(settings, out, running, refusing=refusing, http=f"127.0.0.1:{port}")
    log.info("delay: %d devices (%d refusing), %d rounds, the page in headless Chromium ...", settings["clients"],
             refusing, settings["rounds"])
    load_before = load_average()
    with Chromium(binary, workdir) as chromium:
        watched = asyncio.run(watch_run(chromium.page_socket(), command, port, out, workdir / "page.log"))
    return summarize_delay(watched, refusing, load_before)


def summarize_delay(watched: dict[str, Any], refusing: int, load_before: list[float]) -> dict[str, Any]:
    """Median, p95 and max of shown - emitted (ms) over the events emitted after the page first
    showed the run, overall and by event; the page's poll interval and fetch time."""
    report, live = watched["report"], watched["live"]
    if live is None:
        raise RuntimeError("the page never showed the run live (its status never became 'live')")
    shown = watched["shown"]
    counted = [row for row in shown if row["time"] * 1000 >= live]
    delays = [row["shown"] - row["time"] * 1000 for row in counted]

    def figures(values: list[float]) -> dict[str, Any]:
        return {"count": len(values), "median_ms": percentile(values, 50), "p95_ms": percentile(values, 95),
                "max_ms": max(values) if values else None, "min_ms": min(values) if values else None}

    by_event = {name: figures([row["shown"] - row["time"] * 1000 for row in counted if row["event"] == name])
                for name in sorted({row["event"] for row in counted})}
    starts = [f["start"] for f in watched["fetches"]]
    emitted = (sum(1 for e in report["event_log"] if e["event"] == "registered")
               + sum(r["refused"] + r["late"] + r["missing"] for r in report["rounds"]))
    return {"delay": figures(delays), "by_event": by_event, "poll_ms": poll_ms(),
            "events_shown": len(shown), "events_before_live": len(shown) - len(counted),
            "events_emitted": emitted, "page_live_after_open_ms": live - watched["opened"] * 1000,
            "page_fetches": len(starts),
            "median_poll_interval_ms": float(statistics.median(np.diff(starts))) if len(starts) > 1 else None,
            "median_fetch_ms": statistics.median(f["ms"] for f in watched["fetches"]) if starts else None,
            "max_fetch_ms": max(f["ms"] for f in watched["fetches"]) if starts else None,
            "largest_state_bytes": max(f["bytes"] for f in watched["fetches"]) if starts else None,
            "rounds": [r["seconds"] for r in report["rounds"]], "wall_seconds": report["wall_seconds"],
            "devices": report["clients"], "refusing": refusing, "load_before": load_before,
            "load_after": load_average()}


# -- the work: what the live view adds to the coordinator process, in CPU seconds ----------------
def synthetic_round(round_: int, devices: list[str]) -> list[Any]:
    """The events one round of `devices` emits, as the coordinator emits them."""
    from coordinator.events import RoundAggregated, RoundDevices, RoundEnded, RoundEvaluated, RoundStarted, \
        UpdateAccepted
    from edge_sdk.channel import ChannelSnapshot

    record = {"round": round_, "selected": len(devices), "participants": len(devices), "outcome": "all",
              "seconds": 1.0, "bytes_up": 10**6, "bytes_down": 10**6, "late": 0, "missing": 0, "refused": 0,
              "personalized_accuracy": {"mean": 0.9, "std": 0.05, "min": 0.8, "count": len(devices)}}
    channel = ChannelSnapshot(messages={}, bytes={}, rejections={}, duplicates=0, send_seconds=0.0,
                              accept_seconds=0.0, peak_pending_blobs=0, peak_pending_bytes=0)
    return [RoundStarted(round_, tuple(devices)),
            *(UpdateAccepted(round_, device, 10**6, 0.5, 0.001, 0.001) for device in devices),
            RoundAggregated(round_, len(devices), 0.01), RoundEvaluated(round_, len(devices), 0.9, 0.1),
            RoundEnded(round_, record, channel, RoundDevices(replied=tuple(devices),
                                                           accuracy=dict.fromkeys(devices, 0.9)))]


def work_part(devices: int, rounds: int, polls: int, workdir: Path) -> dict[str, Any]:
    """CPU seconds the live view adds to a coordinator process of a run of `devices`: per event
    (the Prometheus exporter and the page's state, on the round loop's thread) and per poll of
    /state.json and /metrics (the server's threads; the client's urllib counts too, in this same
    process, so the figure is an upper bound), over `rounds` synthetic rounds."""
    from coordinator.config.run_config import RunConfig
    from coordinator.events import DeviceOnline, RunStarted
    from coordinator.observe.session import observing

    names = [f"dev{i:03d}" for i in range(devices)]
    port = free_port()
    config = RunConfig.of(http=f"127.0.0.1:{port}", out=str(workdir / "work"), clients=devices, rounds=rounds)
    with observing(config) as observation:
        events = [RunStarted("run-work", 0, rounds), *(DeviceOnline(d, "trainer", i + 1, devices)
                                                       for i, d in enumerate(names))]
        events += [event for round_ in range(1, rounds + 1) for event in synthetic_round(round_, names)]
        started = time.process_time()
        for event in events:
            observation.on_event(event)
        per_event = (time.process_time() - started) / len(events)
        polled = {}
        for path in ("/state.json", "/metrics"):
            url = f"http://127.0.0.1:{port}{path}"
            size = len(urllib.request.urlopen(url, timeout=10).read())
            started = time.process_time()
            for _ in range(polls):
                urllib.request.urlopen(url, timeout=10).read()
            polled[path] = {"cpu_ms": 1000 * (time.process_time() - started) / polls, "bytes": size}
    per_round = (len(events) - 1 - devices) / rounds
    return {"devices": devices, "rounds": rounds, "polls": polls, "events": len(events),
            "events_per_round": per_round, "cpu_us_per_event": 1e6 * per_event,
            "cpu_ms_per_round_of_events": 1000 * per_event * per_round, "polled": polled}


def work_bound(work: dict[str, Any], seconds_per_round: float) -> float:
    """The most the live view can slow a round of `seconds_per_round`: its events' CPU and one
    /state.json poll a second, as if all of it held up the round loop."""
    polls = seconds_per_round / POLL_SECONDS
    added = work["cpu_ms_per_round_of_events"] / 1000 + polls * work["polled"]["/state.json"]["cpu_ms"] / 1000
    return added / seconds_per_round


# -- the report ----------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def markdown(result: dict[str, Any]) -> str:
    s, m = result["settings"], result["machine"]
    lines = [f"FedAvg on {s['dataset']}, `edgepfl simulate` over {s['broker']}, {s['workers']} device worker "
             f"processes, seed {s['seed']}; machine: {m['cpu_model']}, {m['cores']} cores, {m['ram_gib']} GiB, "
             f"{m['date']}, load average at start {m['load_average_at_start']}.", ""]
    cost = result.get("cost")
    if cost and "arms" in cost:  # (a benchmark cut short leaves its runs only)
        lines += [f"## Round time with and without `--http` ({s['clients']} devices, {s['rounds']} rounds of "
                  f"{s['local_epochs']} local epoch(s), {s['repeats']} repetitions per arm, alternating)", "",
                  "| arm | runs | timed rounds | median s per round | p25-p75 s | each run's median s | CPU s per run "
                  "(median) |", "|---|---|---|---|---|---|---|"]
        for arm, label in (("plain", "without --http"), ("http", "--http, /state.json polled every second")):
            a = cost["arms"][arm]
            lines.append(f"| {label} | {a['runs']} | {a['timed_rounds']} | {a['median_round_seconds']:.3f} "
                         f"| {a['p25_round_seconds']:.3f}-{a['p75_round_seconds']:.3f} "
                         f"| {', '.join(f'{x:.3f}' for x in a['run_medians'])} | {a['median_cpu_seconds']:.1f} |")
        loads = [run["load_before"][0] for run in cost["runs"]] + [run["load_after"][0] for run in cost["runs"]]
        lines += ["", f"Ratio http / plain of the medians: **{cost['ratio']:.3f}** (goal <= {cost['target_ratio']}: "
                  f"{'met' if cost['met'] else 'not met'}); per repetition: "
                  f"{', '.join(f'{x:.3f}' for x in cost['paired_ratios'])} (median {cost['median_paired_ratio']:.3f}); "
                  f"CPU seconds per run http / plain {cost['cpu_ratio']:.3f}. The client fetched /state.json "
                  f"{cost['polls']} times, median {cost['median_fetch_ms']:.1f} ms ({cost['failed_fetches']} "
                  "fetches failed, the run's server gone at its end). "
                  f"Rounds after each run's first; 1-minute load average around the runs {min(loads)}-{max(loads)}.",
                  ""]
    work = result.get("work")
    if work:
        state, metrics = work["polled"]["/state.json"], work["polled"]["/metrics"]
        lines += [f"## The work it adds ({work['devices']} devices, {work['rounds']} synthetic rounds, {work['polls']} "
                  "polls, CPU seconds of this process)", "",
                  f"Per event (exporter and page state, on the round loop's thread): "
                  f"{work['cpu_us_per_event']:.1f} us; {work['events_per_round']:.0f} events a round: "
                  f"{work['cpu_ms_per_round_of_events']:.2f} ms a round. "
                  f"Per poll: /state.json {state['cpu_ms']:.2f} ms ({state['bytes'] / 1000:.1f} KB), /metrics "
                  f"{metrics['cpu_ms']:.2f} ms ({metrics['bytes'] / 1000:.1f} KB), client included."]
        if cost and "arms" in cost:
            seconds = cost["arms"]["plain"]["median_round_seconds"]
            lines.append(f"At the plain arm's {seconds:.3f} s a round and one poll a second, the live view adds at "
                         f"most **{100 * work_bound(work, seconds):.2f}%** to a round (goal <= "
                         f"{100 * (TARGET_RATIO - 1):.0f}%), if all of its work held up the round loop.")
        lines.append("")
    delay = result.get("delay")
    if delay:
        d = delay["delay"]
        lines += [f"## Event to screen ({delay['devices']} devices, {delay['refusing']} refused each round, "
                  f"{len(delay['rounds'])} rounds, headless Chromium)", "",
                  "| events | count | median ms | p95 ms | max ms |", "|---|---|---|---|---|",
                  f"| all | {d['count']} | {_ms(d['median_ms'])} | {_ms(d['p95_ms'])} | {_ms(d['max_ms'])} |"]
        for name, f in delay["by_event"].items():
            lines.append(f"| {name} | {f['count']} | {_ms(f['median_ms'])} | {_ms(f['p95_ms'])} | {_ms(f['max_ms'])} |")
        lines += ["", f"Delay: the row's insertion into the page (`Date.now()`) less the event's emission (its "
                  f"`time`). The page polls every {delay['poll_ms']} ms after its previous render: measured "
                  f"interval {_ms(delay['median_poll_interval_ms'])} ms (median of {delay['page_fetches']} fetches), "
                  f"fetch {_ms(delay['median_fetch_ms'])} ms (max {_ms(delay['max_fetch_ms'])}) for "
                  f"up to {(delay['largest_state_bytes'] or 0) / 1000:.1f} KB of state. {delay['events_shown']} rows "
                  f"shown of {delay['events_emitted']} events emitted; {delay['events_before_live']} emitted before "
                  f"the page first showed the run are not counted. Round seconds "
                  f"{', '.join(f'{x:.2f}' for x in delay['rounds'])}; load average {delay['load_before']} before, "
                  f"{delay['load_after']} after.", ""]
    lines += [f"Command: `{m['command']}`, code {m['code']}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, ", ".join(f"{key} {value}" for key, value in QUICK.items()))
    add_run_flags(parser, SETTINGS, {"dataset": "digits", "clients": None, "rounds": None, "local_epochs": 2,
                                     "workers": 2, "seed": 0})
    parser.add_argument("--repeats", type=int, help=f"runs per arm of the cost part (default {FULL['repeats']})")
    parser.add_argument("--page-clients", type=int, help=f"devices of the page's run (default {FULL['page_clients']})")
    parser.add_argument("--page-rounds", type=int, help=f"rounds of the page's run (default {FULL['page_rounds']})")
    parser.add_argument("--page-refusing", type=int,
                        help=f"devices of the page's run that upload NaN (default {FULL['page_refusing']})")
    parser.add_argument("--parts", default="cost,work,delay",
                        help="comma-separated: cost, work, delay (default all three)")
    args = parser.parse_args()
    sizes = {key: getattr(args, key) if getattr(args, key) is not None else (QUICK if args.quick else FULL)[key]
             for key in QUICK}
    parts = [p for p in args.parts.split(",") if p]
    if not parts or set(parts) - {"cost", "work", "delay"}:
        raise SystemExit(f"error: --parts: {args.parts!r} (cost, work, delay)")
    if sizes["page_refusing"] >= sizes["page_clients"]:
        raise SystemExit("error: --page-refusing must be below --page-clients")
    args.clients, args.rounds = sizes["clients"], sizes["rounds"]
    settings = run_settings(args, SETTINGS)
    setup_logging()
    result: dict[str, Any] = {"machine": machine_info(),
                              "settings": {**settings, **sizes, "broker": args.broker or "mosquitto",
                                           "quick": args.quick, "poll_seconds": POLL_SECONDS, "parts": parts}}
    out = Path(args.out)

    def save(**part: Any) -> None:  # after every run, so that an interrupted benchmark keeps what it measured
        result.update(part)
        write_outputs(out, NAME, result, markdown(result))

    with tempfile.TemporaryDirectory(prefix="edgepfl-observe-") as workdir, \
            broker(args.broker or "mosquitto", Path(workdir)) as running:
        if "cost" in parts:
            save(cost=cost_part(settings, sizes["repeats"], Path(workdir), running,
                                lambda runs: save(cost={"runs": runs})))
        if "work" in parts:
            save(work=work_part(settings["clients"], settings["rounds"], 20 if args.quick else 200, Path(workdir)))
        if "delay" in parts:
            page_settings = {**settings, "clients": sizes["page_clients"], "rounds": sizes["page_rounds"]}
            save(delay=delay_part(page_settings, sizes["page_refusing"], Path(workdir), running))
    print(markdown(result))


if __name__ == "__main__":
    main()
