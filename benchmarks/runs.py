"""Shared helpers of the learning benchmarks (accuracy, communication): cached federated runs.

Not a benchmark itself: a module of the benchmarks package (the scripts run as
`python -m benchmarks.<name>`); nothing in edge_sdk, coordinator or export imports it.

- `Setting`: a data setting by name: `dir0.1` (Dirichlet alpha 0.1), `shards2` (2 classes per
  device), `domains`, `iid`; with `@<fraction>` for the participation (`dir0.1@0.2`).
- `bench_config(...)`: a `RunConfig` with what every benchmark run needs on top of the defaults:
  every selected device must answer before a round is aggregated (a quorum grace as long as
  the `round_timeout`, an hour), because the CLI's quorum defaults (1 reply + 10 s grace) close
  heavy rounds early and would silently drop slow devices from the numbers. Updates are summed
  in float64 (`aggregation_dtype`, part of the fingerprint), so a rerun repeats bit for bit:
  ablation rows differ by their switch, not by the order updates arrived in. An update the
  coordinator rejects (a device whose training diverged uploads NaN) is that device's answer:
  the round aggregates the others' updates.
- `RunCache`: runs a `RunConfig` through `coordinator.hosting.simulate.run_simulation` in a folder named
  by the run's settings and its `RunConfig.fingerprint()` (which leaves `rounds` out, except for
  CD2-pFed, whose schedule spans the round budget: its runs are neither cut nor extended), and, for
  a run with `data_dir`, a hash of that folder's files (`data_tag`: the fingerprint leaves out
  where the files are, so runs on a `fmnist_subset` would otherwise reuse the full dataset's). A run
  whose report already has enough rounds is reused; an interrupted run resumes from its
  checkpoint; a finished run asked for more rounds is extended (the coordinator resumes after
  its last round). Shorter requests read the per-round records of a longer run. With
  `cached_only` nothing is trained: a run not finished in the cache is listed in `missing`.
  Each run it trains records where it ran in `machine.json` beside its report. With a `ledger`
  (`ledger.RunLedger`, committed), every clean run it returns is recorded there, and a run whose
  folder is absent is read from there: the tables outlive the machine that trained the runs.
- `RunPool`: runs of one cache side by side, a process each, highest priority first (a
  benchmark's `--jobs`); the tables are then read from the cache.
- `RunView`: a report cut at the rounds asked for: accuracy, bytes, rounds to a target.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import hashlib
import heapq
import json
import logging
import math
import multiprocessing
import shutil
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Hashable, Iterator, Sequence

from ._machine import machine_info
from .ledger import DEFAULT_LEDGER, RunLedger
from coordinator.config.run_config import KEYS, RunConfig
from coordinator.hosting.simulate import run_simulation, skip_final_collection
from coordinator.run.folder import RunFolder
from edge_sdk.algorithms import in_table_order
from edge_sdk.protocol import Reason

log = logging.getLogger("benchmarks")

DEFAULT_CACHE = "benchmarks/results/runs"
"""Where finished runs are kept, shared by accuracy.py and communication.py."""

_DEVICES = in_table_order()
ALGORITHMS: tuple[str, ...] = tuple(cls.id for cls in _DEVICES)
"""Every algorithm id in the tables' order (each device class's `table_rank`)."""
NAMES = {cls.id: cls.display_name for cls in _DEVICES}
"""Algorithm ids as the tables name them (each device class's `display_name`)."""

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#000000", "#b8860b")
PAPER_METHODS = tuple(cls.id for cls in _DEVICES if cls.paper_method)
"""The five papers' methods, in the tables' order (each device class's `paper_method`)."""


def line_style(algorithm: str) -> dict[str, Any]:
    """Matplotlib keywords that tell the twelve algorithms apart in one plot: a colour of their own
    and solid lines for the five papers' methods, dashed for the baselines."""
    index = ALGORITHMS.index(algorithm)
    return {"color": _COLORS[index % len(_COLORS)], "linestyle": "-" if algorithm in PAPER_METHODS else "--",
            "label": NAMES[algorithm]}


# -- settings ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """A data partition and a participation fraction, named like `dir0.1@0.2`."""

    partition: str
    alpha: float = 0.5
    classes_per_client: int = 2
    fraction: float = 1.0

    @classmethod
    def parse(cls, text: str) -> Setting:
        name, _, fraction = text.partition("@")
        fraction_value = float(fraction) if fraction else 1.0
        if name.startswith("dir"):
            return cls("dirichlet", alpha=float(name[3:]), fraction=fraction_value)
        if name.startswith("shards"):
            return cls("shards", classes_per_client=int(name[6:] or 2), fraction=fraction_value)
        if name in ("domains", "iid"):
            return cls(name, fraction=fraction_value)
        raise ValueError(f"unknown setting {text!r}: dir<alpha>, shards<k>, domains or iid, optionally @<fraction>")

    @property
    def partition_name(self) -> str:
        if self.partition == "dirichlet":
            return f"dir{self.alpha:g}"
        if self.partition == "shards":
            return f"shards{self.classes_per_client}"
        return self.partition

    @property
    def name(self) -> str:
        return f"{self.partition_name}@{self.fraction:g}"

    @property
    def data_label(self) -> str:
        """The partition alone, for the columns of a table per participation fraction, e.g. `Dir(0.1)`."""
        return {"dirichlet": f"Dir({self.alpha:g})", "shards": f"{self.classes_per_client} cls/dev",
                "domains": "domains", "iid": "IID"}[self.partition]

    @property
    def label(self) -> str:
        """For table headers, e.g. `Dir(0.1), C=0.2`."""
        return f"{self.data_label}, C={self.fraction:g}"

    def fields(self) -> dict[str, Any]:
        return {"partition": self.partition, "alpha": self.alpha, "classes_per_client": self.classes_per_client,
                "fraction": self.fraction}


def bench_config(**fields: Any) -> RunConfig:
    """A RunConfig for a benchmark run: all selected devices must answer, rounds never time out
    in practice, two device workers, float64 aggregation (so a rerun of the same settings gives
    the same models and figures), and a test for every `RunConfig` field asked for."""
    missing = sorted(set(fields) - set(KEYS) - {"hyper"})
    if missing:
        raise ValueError(f"this checkout's RunConfig has no field {', '.join(missing)}")
    defaults = {"workers": 2, "round_timeout": 3600.0, "min_clients": 1, "registration_timeout": 600.0,
                "aggregation_dtype": "float64"}
    merged = {**defaults, **fields}
    merged.setdefault("quorum_grace", merged["round_timeout"])
    return RunConfig.of(**merged)


def has_field(name: str) -> bool:
    return name in KEYS or name == "hyper"


def diverged_in(record: dict[str, Any]) -> int:
    """A round record's updates rejected as non-finite (devices whose training diverged)."""
    return record.get("rejections", {}).get(Reason.NON_FINITE.value, 0)


# -- a run, cut at the rounds asked for -----------------------------------------------------
@dataclass
class RunView:
    """The report of a run as of round `rounds` (the run itself may have gone further)."""

    config: RunConfig
    report: dict[str, Any]
    out: Path
    rounds: int
    cached: bool
    seconds: float  # this call's wall time (0 when reused)
    trainer: dict[str, Any] | None = None  # machine_info() of the machine that trained it (None: unrecorded)

    @property
    def records(self) -> list[dict[str, Any]]:
        return [r for r in self.report["rounds"] if r["round"] <= self.rounds]

    @property
    def exact(self) -> bool:
        """True when the run stopped at `rounds`, so its checkpoint and device states are of that round."""
        return self.report["rounds_completed"] == self.rounds

    def personalized(self) -> dict[str, float | None]:
        """Mean, std and min over devices of the personalized accuracy at round `rounds`."""
        if self.exact:
            final = self.report["final"]["personalized_accuracy"]
            return {"mean": final["mean"], "std": final["std"], "min": final["min"]}
        record = self.records[-1]["personalized_accuracy"] or {}
        return {"mean": record.get("mean"), "std": record.get("std"), "min": record.get("min")}

    @property
    def diverged_updates(self) -> int:
        """Updates the coordinator rejected as non-finite: a device whose training diverged."""
        return sum(diverged_in(r) for r in self.records)

    def best_mean(self) -> float | None:
        means = [r["personalized_accuracy"]["mean"] for r in self.records if r["personalized_accuracy"]]
        return max(means) if means else None

    def global_accuracy(self) -> float | None:
        if self.exact:
            return self.report["final"]["global_accuracy"]
        return self.records[-1].get("global_accuracy")

    def machine(self) -> str:
        """Where the run was trained, in one line (`unrecorded` for runs older than machine.json)."""
        info = self.trainer
        if info is None:
            return "unrecorded"
        return f"{info['cpu_model']}, {info['cores']} cores" + (f", {info['gpu']}" if info.get("gpu") else "") + (
            f", torch {info['torch']}")

    def holdout(self) -> dict[str, Any] | None:
        return self.report["final"].get("holdout_accuracy") if self.exact else None

    def run_seconds(self) -> float:
        """Seconds of the rounds up to `rounds` (the coordinator's round timer)."""
        return sum(r["seconds"] for r in self.records)

    # -- traffic ------------------------------------------------------------------------
    def traffic(self) -> dict[str, float]:
        """Per-round bytes, from `communication.by_kind` (whole run) apportioned per round.

        up_train: TRAIN_RES bytes per round; up_train_per_device: per participating device;
        down_train: TRAIN bytes per round as the coordinator publishes them (one broadcast);
        down_train_delivered: the same times the devices subscribed (the broker's fan-out);
        eval_per_round: EVALUATE + EVAL_RES bytes per evaluation; total_*: rounds[] sums
        (everything, evaluation and control included), per round.
        """
        report = self.report
        by_kind = report["communication"]["by_kind"]
        completed = max(1, report["rounds_completed"])
        participants = sum(r["participants"] for r in report["rounds"]) or 1
        evaluations = sum(1 for r in report["rounds"] if r["personalized_accuracy"]) or 1
        up_train = by_kind["up"].get("train_res", 0)
        down_train = by_kind["down"].get("train", 0)
        evaluation = by_kind["down"].get("evaluate", 0) + by_kind["up"].get("eval_res", 0)
        return {
            "up_train": up_train / completed,
            "up_train_per_device": up_train / participants,
            "down_train": down_train / completed,
            "down_train_delivered": down_train / completed * report["clients"],
            "eval_per_round": evaluation / evaluations,
            "total_up": sum(r["bytes_up"] for r in report["rounds"]) / completed,
            "total_down": sum(r["bytes_down"] for r in report["rounds"]) / completed,
        }

    def rounds_to(self, target: float) -> dict[str, Any]:
        """The first round whose mean personalized accuracy reaches `target`, and the training
        traffic until then: uploads plus the TRAIN broadcasts as delivered to every device."""
        traffic = self.traffic()
        report = self.report
        participants = sum(r["participants"] for r in report["rounds"]) or 1
        per_device_up = report["communication"]["by_kind"]["up"].get("train_res", 0) / participants
        down_delivered = traffic["down_train_delivered"]
        up = down = 0.0
        for record in self.records:
            up += record["participants"] * per_device_up
            down += down_delivered
            mean = (record["personalized_accuracy"] or {}).get("mean")
            if mean is not None and mean >= target:
                return {"reached": True, "round": record["round"], "mb_up": up / 1e6, "mb_down": down / 1e6,
                        "mb_total": (up + down) / 1e6, "accuracy": mean}
        return {"reached": False, "round": None, "rounds_run": len(self.records), "mb_up": None, "mb_down": None,
                "mb_total": None, "accuracy": self.best_mean()}


# -- the cache --------------------------------------------------------------------------------
MACHINE_FILE = "machine.json"
"""Beside a cached run's report: `machine_info()` of the machine that trained it."""


def trainer_machine(config: RunConfig) -> dict[str, Any]:
    """The machine about to train `config`, with the accelerator its devices will take."""
    import torch  # noqa: F401  (imported first, so that machine_info names the GPU)

    from edge_sdk.training import pick_device

    return {**machine_info(), "device": str(pick_device(config.simulation.device))}


def recorded_machine(out: Path) -> dict[str, Any] | None:
    """The machine.json of run folder `out` (None for runs older than it)."""
    path = out / MACHINE_FILE
    return json.loads(path.read_text()) if path.exists() else None


LOCAL_KEYS = ("out", "broker")
"""Settings of where a run was trained, not of what it is: left out of its ledger record."""


@functools.cache
def data_tag(data_dir: str) -> str:
    """`-d<hash>` of the files in `data_dir` (names and contents): `data_dir` is no part of a run's
    fingerprint (it says where the files are, not which), so runs on a subset (`fmnist_subset`)
    would otherwise share the folder and ledger record of the full dataset's runs."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(data_dir).iterdir() if p.is_file()):
        digest.update(path.name.encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return f"-d{digest.hexdigest()[:8]}"


def run_folder_name(config: RunConfig) -> str:
    setting = Setting(config.run.partition, config.run.alpha, config.run.classes_per_client, config.round.fraction)
    evaluation = "" if config.round.eval_every == 1 else f"-e{config.round.eval_every}"  # not in the fingerprint
    data = data_tag(config.run.data_dir) if config.run.data_dir else ""  # nor is where the files are
    return (f"{config.run.algorithm}-{config.run.dataset}-{setting.partition_name}-f{config.round.fraction:g}"
            f"-s{config.training.seed}"
            f"{evaluation}{data}-{config.fingerprint()}")


class RunCache:
    """Finished runs under `root`, one folder per fingerprint; see the module docstring."""

    def __init__(self, root: str | Path, *, broker: str | None = None, fresh: bool = False,
                 cached_only: bool = False, ledger: str | Path | None = None, from_ledger: bool = True):
        if fresh and cached_only:
            raise ValueError("fresh (recompute) and cached_only (train nothing) exclude each other")
        self.root = Path(root)
        self.broker = broker
        self.ledger = RunLedger(ledger) if ledger is not None else None
        self.from_ledger = from_ledger  # False: a run counts only with its folder (records are still written)
        self.fresh = fresh
        self.cached_only = cached_only
        self.failures: list[dict[str, Any]] = []
        self.missing: list[str] = []  # with cached_only: runs asked for and not in the cache
        self._cleared: set[Path] = set()
        self._failed: set[Path] = set()

    def folder(self, config: RunConfig) -> Path:
        return self.root / run_folder_name(config)

    def run(self, config: RunConfig) -> RunView | None:
        """The run of `config` as of `config.training.rounds` rounds (None, logged, if it failed).

        A lock file beside the run's folder keeps two benchmark processes from driving the same
        run at once: the second waits for the first and then reuses its result (with `cached_only`
        it does not wait: the run is missing)."""
        out = self.folder(config)
        if out in self._failed:  # failed earlier in this invocation: not tried twice
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f".{out.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if self.cached_only:  # being trained right now: not finished
                    self.missing.append(out.name)
                    return None
                log.info("%s is in use by another benchmark process; waiting", out.name)
                fcntl.flock(lock, fcntl.LOCK_EX)
            return self._run_locked(config, out)

    def _run_locked(self, config: RunConfig, out: Path) -> RunView | None:
        config = config.replace(out=str(out), broker=self.broker)
        report_path = RunFolder(out).report
        if self.fresh and out not in self._cleared:  # --fresh: recompute once per invocation
            shutil.rmtree(out, ignore_errors=True)
            self._cleared.add(out)
        if report_path.exists():
            report = json.loads(report_path.read_text())
            if report["rounds_completed"] >= config.training.rounds:
                return self._recorded(self._checked(RunView(config, report, out, config.training.rounds, cached=True,
                                                            seconds=0.0, trainer=recorded_machine(out))))
        recorded = self._from_ledger(config, out)
        if recorded is not None:
            return recorded
        if self.cached_only:
            self.missing.append(out.name)
            return None
        if report_path.exists():
            log.info("extending %s from %d to %d rounds", out.name, report["rounds_completed"], config.training.rounds)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_config.json").write_text(json.dumps(config.to_flat(), indent=2, default=str))
        trainer = trainer_machine(config)
        (out / MACHINE_FILE).write_text(json.dumps(trainer, indent=2))
        started = time.monotonic()
        try:
            report = run_simulation(config)
        except Exception as exc:  # noqa: BLE001  (one failed run must not end a long benchmark)
            log.exception("run %s failed", out.name)
            self.failures.append({"run": out.name, "error": f"{type(exc).__name__}: {exc}"})
            self._failed.add(out)
            return None
        seconds = time.monotonic() - started
        if report["rounds_completed"] < config.training.rounds:
            self.failures.append({"run": out.name, "error": f"stopped after {report['rounds_completed']} rounds"})
            self._failed.add(out)
            return None
        return self._recorded(self._checked(RunView(config, report, out, config.training.rounds, cached=False,
                                                    seconds=seconds, trainer=trainer)))

    def _from_ledger(self, config: RunConfig, out: Path) -> RunView | None:
        """The ledger's record of this run when it ran at least the rounds asked for (not with
        `fresh`: a recomputed run replaces its record)."""
        if self.ledger is None or self.fresh or not self.from_ledger:
            return None
        entry = self.ledger.get(out.name)
        if entry is None or entry["report"]["rounds_completed"] < config.training.rounds:
            return None
        log.info("%s: read from the ledger (%s)", out.name, self.ledger.root)
        return RunView(config, entry["report"], out, config.training.rounds, cached=True, seconds=0.0,
                       trainer=entry["machine"])

    def _recorded(self, view: RunView | None) -> RunView | None:
        """`view`, after its run is recorded in the ledger (a clean run only: `_checked` passed)."""
        if view is not None and self.ledger is not None:
            settings = {key: value for key, value in view.config.to_flat().items() if key not in LOCAL_KEYS}
            self.ledger.record(view.out.name, settings, view.trainer, view.report)
        return view

    def adopt_failures(self, failures: list[dict[str, Any]]) -> None:
        """Failures another process met on this cache (a `RunPool` run): reported with this
        cache's, and those runs are not tried again in this invocation."""
        self.failures.extend(failures)
        self._failed.update(self.root / failure["run"] for failure in failures)

    def _checked(self, view: RunView) -> RunView | None:
        """The view, or None when the run is not a clean measurement (a device missing from a
        round, no final accuracy): then its folder is moved aside to `<name>.failed-<time>` so
        that the next invocation starts it afresh instead of resuming a broken run. A device
        whose update was rejected as non-finite is not missing: its training diverged, which is
        the algorithm's result (counted in `diverged_updates`)."""
        problems = [f"round {r['round']}: {r['participants']} of {r['selected']} devices replied ({r['outcome']})"
                    for r in view.records
                    if r["participants"] + diverged_in(r) < r["selected"]]
        if view.personalized()["mean"] is None:
            problems.append("no personalized accuracy")
        if not problems:
            return view
        aside = view.out.with_name(f"{view.out.name}.failed-{time.strftime('%Y%m%dT%H%M%S')}")
        view.out.rename(aside)
        log.warning("run %s is not a clean measurement (%s); moved to %s", view.out.name, "; ".join(problems[:3]),
                    aside.name)
        self.failures.append({"run": view.out.name, "error": "; ".join(problems[:3]), "moved_to": aside.name})
        self._failed.add(view.out)
        return None


# -- runs side by side ---------------------------------------------------------------------------
def _run_in_child(root: str, broker: str | None, ledger: str | None, from_ledger: bool, config: RunConfig,
                  then: Callable[[RunView], None] | None) -> list[dict[str, Any]]:
    """A `RunPool` process: one run through a RunCache of its own, then `then` on its view (when
    it finished cleanly); returns its failures."""
    setup_logging()
    cache = RunCache(root, broker=broker, ledger=ledger, from_ledger=from_ledger)
    view = cache.run(config)
    if view is not None and then is not None:
        then(view)
    return cache.failures


def _skip_final_collection_at_exit() -> None:
    """A pool process leaves its heap out of the interpreter's last collection, as simulate's
    workers do (`skip_final_collection`): the benchmark waits for its pool to end."""
    atexit.register(skip_final_collection)


class RunPool:
    """Trains runs of `cache` up to `jobs` at a time, each in a process started afresh (spawn: no
    state of the parent's torch or broker threads is inherited), the highest priority first (ties
    in submission order). Runs finished in the cache return at once; a run's failure is adopted
    by `cache`, so the benchmark's sequential pass that follows reports it and does not retry it.

    Runs on a GPU share it: each device worker process holds a CUDA context of its own. `then`, a
    module-level function (it is pickled to the child), runs in the run's process on its finished
    view: work on the run's folder that parallelizes with the run, such as fitting heads on its
    release."""

    def __init__(self, cache: RunCache, jobs: int, *, then: Callable[[RunView], None] | None = None):
        if jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {jobs}")
        self.cache = cache
        self.jobs = jobs
        self.then = then
        self._executor = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_skip_final_collection_at_exit)
        self._queue: list[tuple[float, int, RunConfig, Hashable]] = []
        self._running: dict[Future, tuple[RunConfig, Hashable]] = {}
        self._submitted = 0

    def submit(self, config: RunConfig, tag: Hashable = None, *, priority: float = 0.0) -> None:
        """Queue `config`; `completed()` yields `tag` once it ended."""
        heapq.heappush(self._queue, (-priority, self._submitted, config, tag))
        self._submitted += 1

    def run_all(self) -> None:
        """Train everything submitted, up to `jobs` at a time."""
        for _ in self.completed():
            pass

    def completed(self) -> Iterator[Hashable]:
        """The tags of the runs as they end (runs may be submitted meanwhile); shuts the pool
        down once nothing is queued or running."""
        with self._executor:
            self._fill()
            while self._running:
                done, _ = wait(self._running, return_when=FIRST_COMPLETED)
                for future in done:
                    config, tag = self._running.pop(future)
                    self._collect(future, config)
                    yield tag
                self._fill()

    def _fill(self) -> None:
        while self._queue and len(self._running) < self.jobs:
            _, _, config, tag = heapq.heappop(self._queue)
            ledger = str(self.cache.ledger.root) if self.cache.ledger is not None else None
            future = self._executor.submit(_run_in_child, str(self.cache.root), self.cache.broker, ledger,
                                           self.cache.from_ledger, config, self.then)
            self._running[future] = (config, tag)

    def _collect(self, future: Future, config: RunConfig) -> None:
        try:
            failures = future.result()
        except Exception as exc:  # noqa: BLE001  (the process itself died: that run failed, the others go on)
            failures = [{"run": run_folder_name(config), "error": f"{type(exc).__name__}: {exc}"}]
            log.error("run %s: its process failed: %s", failures[0]["run"], failures[0]["error"])
        self.cache.adopt_failures(failures)


# -- arguments ------------------------------------------------------------
def ledger_folder(ledger: str | None, quick: bool) -> str | None:
    """The ledger a benchmark invocation reads and writes: `--ledger`, else the committed one
    (none for a quick smoke run, which must not write into the repository)."""
    if ledger == "none":
        return None
    return ledger or (None if quick else DEFAULT_LEDGER)


# -- formatting -----------------------------------------------------------
def listed(text: str) -> list[str]:
    """The items of a comma-separated command-line value, blanks dropped."""
    return [t.strip() for t in text.split(",") if t.strip()]


def mean_std(values: Sequence[float | None]) -> dict[str, Any]:
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"mean": None, "std": None, "n": 0}
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return {"mean": mean, "std": std, "n": len(xs)}


def pct(cell: dict[str, Any] | None, *, with_std: bool = True) -> str:
    """`85.31 ± 1.20` (percent) for a mean_std cell; `-` when empty."""
    if not cell or cell.get("mean") is None:
        return "-"
    if with_std and cell.get("n", 0) > 1:
        return f"{100 * cell['mean']:.2f} ± {100 * cell['std']:.2f}"
    return f"{100 * cell['mean']:.2f}"


def trained_on(machines: list[str]) -> str:
    """`Runs trained on: <machine> (n runs); ...`: where the runs of a table were trained (RunView.machine)."""
    counts = Counter(machines)
    return "Runs trained on: " + ("; ".join(f"{machine} ({n} runs)" for machine, n in counts.items()) or "-") + "."


def trailer(document: dict[str, Any], machines: list[str]) -> list[str]:
    """The lines a benchmark's tables end with: where their runs were trained, where and by which
    command the tables were made, and the runs that failed."""
    machine = document["machine"]
    lines = ["", trained_on(machines), "",
             f"Tables made on: {machine['cores']} cores, {machine['ram_gib']} GiB, {machine['cpu_model']}; "
             f"torch {machine['torch']}; load average at start {machine['load_average_at_start']}. "
             f"Command: `{machine['command']}`", ""]
    if document["failures"]:
        lines += ["Failed runs: " + "; ".join(f"{f['run']}: {f['error']}" for f in document["failures"]), ""]
    return lines


def setup_logging() -> None:
    """Progress lines of the benchmark on stderr; the library (and the device workers, which
    inherit the root level) only warns."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    log.setLevel(logging.INFO)
    logging.getLogger("amqtt").setLevel(logging.ERROR)
    logging.getLogger("transitions").setLevel(logging.ERROR)


def write_outputs(out: Path, name: str, document: dict[str, Any], markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(document, indent=2, default=str))
    (out / f"{name}.md").write_text(markdown)
