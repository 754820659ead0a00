"""What a run reports: a line per round in metrics.jsonl and the run's report.json.

`RoundRecord` is one round's line: who took part (selected, aggregated, refused, late,
missing), what it reached and what it cost. `run_report` builds the report from the ledger
(rounds, final evaluation, traffic, rejections, events) and the run's settings. A rerun of a
run that already played all its rounds returns that run's report unchanged (`finished_report`).
Writing and reading the files is `coordinator.run.report_files`'s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from edge_sdk.config import to_plain
from edge_sdk.privacy.settings import DELTA_CAP

from ..config.run_config import RunConfig
from ..fleet.devices import Device
from ..releases.phase import Release
from . import checkpoint
from .folder import RunFolder
from .ledger import Ledger
from .report_files import async_summary, data_report, read_report, secagg_report, summarize


@dataclass
class RoundRecord:
    """A round's line in metrics.jsonl: who took part, what it reached, what it cost."""

    round: int
    selected: int
    participants: int
    """Fresh updates aggregated (0 when the round is below its quorum: nothing is aggregated)."""
    outcome: str
    personalized_accuracy: dict | None
    global_accuracy: float | None
    bytes_up: int
    bytes_down: int
    """Published by the coordinator (a broadcast counts once)."""
    seconds: float
    rejections: dict[str, int] = field(default_factory=dict)
    replied: int = 0
    """Valid updates received in time (more than `participants` in a round below its quorum)."""
    refused: int = 0
    """Selected devices whose update was rejected."""
    device_refusals: dict[str, int] = field(default_factory=dict)
    """Requests of the round (its TRAIN, its evaluation) that devices refused themselves, by reason."""
    late: int = 0
    """Selected devices still training, online, when the round closed."""
    missing: int = 0
    """Selected devices that went offline before replying."""
    late_folded: int = 0
    """Late updates of the previous round aggregated into this one (`late_updates = "next_round"`)."""
    late_discarded: int = 0
    """Late updates that arrived during this round and were dropped."""
    bytes_down_delivered: int = 0
    """What the broker delivered: each broadcast once per online registered device."""
    lost_shards: list[int] = field(default_factory=list)
    """Shards (`shards` > 0) whose partial was not aggregated: aggregator gone, partial refused or late."""
    lost_updates: int = 0
    """Updates a lost shard's aggregator had folded: checked, but not aggregated."""
    privacy: dict | None = None
    """Under DP: epsilon spent so far (and at what delta, noise, clip), `RunPrivacy.record`."""
    secagg: dict | None = None
    """Under secure aggregation: how far the devices got through its stages (`SecureRoundRecord`)."""
    asynchronous: dict | None = None
    """Under `mode async`, the aggregation step's arrivals, their staleness and the updates refused
    as too stale (`async_steps.StepRecord`)."""


def finished_report(config: RunConfig) -> dict[str, Any] | None:
    """The report of the run in `config.run.out` if that run already played `config.training.rounds`
    rounds and wrote its report (a rerun then changes nothing), else None. A checkpoint of a run
    with other settings raises `CheckpointError`."""
    folder = RunFolder(config.run.out)
    saved = checkpoint.load(folder.checkpoint)
    if saved is None:
        return None
    if saved.fingerprint != config.fingerprint():
        raise checkpoint.CheckpointError(
            f"{folder.path} holds run {saved.run_id} with other settings; use another --out to start a new run")
    return played_report(folder, saved.run_id, saved.round, config.training.rounds)


def played_report(folder: RunFolder, run_id: str, completed: int, rounds: int) -> dict[str, Any] | None:
    """The report of run `run_id` if it played all `rounds` (`completed` of them checkpointed)."""
    if completed < rounds:
        return None
    report = read_report(folder)
    if report is None or report.get("run_id") != run_id or report.get("rounds_completed") != completed:
        return None
    return report


def run_report(config: RunConfig, hyper: Any, *, run_id: str, completed: int, ledger: Ledger,
               release: Release | None, devices: Iterable[Device], devices_registered: int,
               partition: str | None, wall_seconds: float, privacy: dict[str, Any] | None = None,
               stopped: str | None = None, init_from: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's report: its settings, every round's record, the final evaluation, the release,
    the traffic, rejections and events, from the `ledger` of every incarnation of the run; what it
    started from when it had `init_from` (`coordinator.run.warm_start.WarmStart.record`)."""
    rounds = ledger.rounds
    means = [r["personalized_accuracy"]["mean"] for r in rounds if r["personalized_accuracy"]]
    final = ledger.final or {}
    summary = summarize(m["accuracy"] for m in final.values() if not m.get("holdout")) or {}
    if privacy is not None and privacy.get("released_accuracy") is not None:
        summary = {"mean": privacy["released_accuracy"]}  # private evaluation: a noised mean, no spread
    holdout = summarize(m["accuracy"] for m in final.values() if m.get("holdout"))
    global_summary = summarize(m["global_accuracy"] for m in final.values() if "global_accuracy" in m)
    by_kind = {kind: summarize(m["accuracy"] for m in final.values()
                               if m.get("kind") == kind and not m.get("holdout"))
               for kind in sorted({m.get("kind") for m in final.values()})}
    traffic = ledger.traffic()
    delivered = ledger.delivered()
    published_down = sum(traffic["sent"].values())
    return {
        "run_id": run_id,
        "algorithm": config.run.algorithm,
        "hyperparameters": to_plain(hyper),
        "dataset": config.run.dataset,
        **({"partition": partition} if partition is not None else {}),
        "data": data_report(devices, config.task().num_classes),
        "model": config.model_name,
        **({"init_from": init_from} if init_from is not None else {}),
        "clients": config.run.clients,
        "fraction": config.round.fraction,
        "evaluated_on": "validation" if config.training.validation_fraction else "test",
        "rounds_completed": completed,
        "rounds_aggregated": sum(1 for r in rounds if r["outcome"] != "aborted"),
        "late_updates": {"policy": config.round.late_updates,
                         "folded": sum(r.get("late_folded", 0) for r in rounds),
                         "discarded": sum(r.get("late_discarded", 0) for r in rounds)},
        "rounds": rounds,
        "final": {
            "personalized_accuracy": {
                "mean": summary.get("mean"),
                "std": summary.get("std"),
                "min": summary.get("min"),
                "best_round_mean": max(means) if means else None,
            },
            "devices_evaluated": len(final),
            "devices_registered": devices_registered,
            "per_client": {cid: final[cid] for cid in sorted(final)},
            "global_accuracy": global_summary["mean"] if global_summary else None,
            "holdout_accuracy": holdout,
            "by_kind": by_kind,
        },
        "release": release.manifest() | {"path": str(release.path)} if release else None,
        "communication": {
            "bytes_up": sum(traffic["received"].values()),
            "bytes_down": published_down,
            "bytes_down_published": published_down,
            "bytes_down_delivered": sum(delivered.values()),
            "by_kind": {"up": traffic["received"], "down": traffic["sent"], "down_delivered": delivered},
        },
        "rejections": ledger.rejections(),
        "device_refusals": device_refusals(ledger.rounds),
        "duplicates_dropped": ledger.duplicates(),
        "events": ledger.event_counts(),
        "event_log": ledger.events,
        "wall_seconds": wall_seconds,
        **({"privacy": privacy} if privacy is not None else {}),
        **({"dp_sgd": dp_sgd_report(config, final)} if config.privacy.dp_sgd else {}),
        **({"stopped": stopped} if stopped is not None else {}),
        **({"asynchronous": steps} if (steps := async_summary(rounds)) is not None else {}),
        **({"secagg": secagg_report(config.secagg, rounds, sharded=config.round.shards > 0)}
           if config.secagg.secure_aggregation else {}),
    }


def dp_sgd_report(config: RunConfig, final: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Record-level DP-SGD of the run: its settings, the largest epsilon a device reported at the
    last evaluation (None where the devices keep it to themselves, under private evaluation), the
    delta every device's is at (at most: the default is each device's own, min(1e-5, 0.01 /
    examples), and an epsilon at a smaller delta holds at a larger one), and where the batches came
    from: secret (accounted with amplification by sampling) or the run's seed (accounted without)."""
    privacy = config.privacy
    reported = [m["dp_sgd_epsilon"] for m in final.values() if isinstance(m.get("dp_sgd_epsilon"), (int, float))]
    return {"noise_multiplier": privacy.dp_sgd_noise, "clip": privacy.dp_sgd_clip,
            "delta": privacy.dp_sgd_delta or DELTA_CAP, "delta_per_device": privacy.dp_sgd_delta == 0,
            "batches": "from the run's seed, not amplified" if privacy.dp_reproducible_noise else "secret",
            "epsilon_max": max(reported) if reported else None, "devices_reporting": len(reported)}


def device_refusals(rounds: list[dict[str, Any]]) -> dict[str, int]:
    """The requests devices refused themselves over the run's rounds, by reason."""
    totals: Counter[str] = Counter()
    for record in rounds:
        totals.update(record.get("device_refusals", {}))
    return dict(sorted(totals.items()))
