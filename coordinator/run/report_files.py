"""What a run leaves in `--out` besides its state: the metrics log (one line per round), the
report and its curves (file names in `RunFolder`), and what the report says of the devices'
data: the example counts and label histograms they reported, not a partition the coordinator
cannot know when devices hold their own data."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from collections.abc import Iterable
from typing import Any

from edge_sdk.privacy.disclosure import EXAMPLES_BUCKET
from edge_sdk.privacy.secagg_settings import SecAggSettings
from edge_sdk.secagg.bounds import tolerance
from edge_sdk.store import write_atomic

from ..fleet.devices import Device
from .folder import RunFolder

log = logging.getLogger(__name__)


def summarize(values: Iterable[float | None]) -> dict[str, float] | None:
    """Mean, std and min over devices (None when there are none). The sums are exactly rounded
    (fsum), so the figures do not depend on the order the devices' results arrived in."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return None
    mean = math.fsum(xs) / len(xs)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))
    return {"mean": mean, "std": std, "min": min(xs), "count": len(xs)}


class MetricsLog:
    """Append-only JSON lines; a round already in the file is never written again."""

    def __init__(self, path: Path):
        self.path = path
        self.recorded: set[int] = set()
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by a crash mid-write
                if entry.get("event") == "round":
                    self.recorded.add(int(entry["round"]))

    def append(self, entry: dict[str, Any]) -> None:
        if entry.get("event") == "round":
            if entry["round"] in self.recorded:
                return
            self.recorded.add(entry["round"])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as handle:
            handle.seek(0, 2)
            torn = handle.tell() > 0 and (handle.seek(-1, 2), handle.read(1))[1] != b"\n"
        with open(self.path, "a") as handle:
            handle.write(("\n" if torn else "") + json.dumps(entry, sort_keys=True) + "\n")
            handle.flush()


def write_report(folder: RunFolder, report: dict[str, Any]) -> None:
    """The report (atomically) and its curves."""
    write_atomic(folder.report, json.dumps(report, indent=2, sort_keys=True).encode())
    plot_curves(folder.curves, report)


def read_report(folder: RunFolder) -> dict[str, Any] | None:
    """The report a run wrote, None if there is none (or it is unreadable: the run did not end)."""
    try:
        return json.loads(folder.report.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def cumulative_megabytes(report: dict[str, Any]) -> list[float]:
    """Cumulative MB (up + down as published) after each round, then, as the last point, the
    run's total: registration, the release and the final evaluation included, so the last value
    is `communication.bytes_up + bytes_down` whatever happened outside the rounds."""
    points, total = [], 0
    for record in report["rounds"]:
        total += record["bytes_up"] + record["bytes_down"]
        points.append(total / 1e6)
    comm = report["communication"]
    points.append((comm["bytes_up"] + comm["bytes_down"]) / 1e6)
    return points


def participation_line(record: dict[str, Any]) -> str | None:
    """'round 3: 1 of 4 selected devices aggregated, 3 late' for a round that did not aggregate
    every selected device (None for one that did)."""
    selected, aggregated = record["selected"], record["participants"]
    if (aggregated == selected or record.get("asynchronous")) and record["outcome"] != "aborted":
        return None  # an async step aggregates arrivals, not a selection
    parts = [f"{record.get(key, 0)} {key}" for key in ("late", "missing", "refused") if record.get(key, 0)]
    if record["outcome"] == "aborted":
        parts.insert(0, f"nothing aggregated ({record.get('replied', 0)} replied, below the quorum)")
    else:
        parts.insert(0, f"{aggregated} of {selected} selected devices aggregated")
    if record.get("late_folded"):
        parts.append(f"{record['late_folded']} late updates of round {record['round'] - 1} folded in")
    return f"round {record['round']}: " + ", ".join(parts)


def async_summary(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A run's aggregation steps under `mode async` (its rounds carry `asynchronous`): steps,
    arrivals folded, devices asked, updates refused as too stale, and the staleness histogram
    with its mean and maximum; None for a run of synchronous rounds."""
    steps = [r["asynchronous"] for r in rounds if r.get("asynchronous")]
    if not steps:
        return None
    histogram: dict[int, int] = {}
    for step in steps:
        for staleness, count in step["staleness"].items():
            histogram[int(staleness)] = histogram.get(int(staleness), 0) + count
    arrivals = sum(histogram.values())
    return {"steps": len(steps), "arrivals": arrivals, "dispatched": sum(s["dispatched"] for s in steps),
            "too_stale": sum(s["too_stale"] for s in steps),
            "staleness": {str(k): histogram[k] for k in sorted(histogram)},
            "staleness_mean": sum(k * n for k, n in histogram.items()) / arrivals if arrivals else None,
            "staleness_max": max(histogram) if histogram else None}


def async_line(summary: dict[str, Any]) -> str:
    """'12 steps, 48 arrivals (staleness mean 1.3, max 4), 2 refused as too stale' for a report's `asynchronous`."""
    mean = summary["staleness_mean"]
    staleness = "" if mean is None else f" (staleness mean {mean:.2f}, max {summary['staleness_max']})"
    return (f"{summary['steps']} steps, {summary['arrivals']} arrivals{staleness} of {summary['dispatched']} "
            f"trainings asked, {summary['too_stale']} refused as too stale")


def secagg_line(rounds: list[dict[str, Any]]) -> str | None:
    """'3 of 3 rounds unmasked, 1 device lost after sharing its keys ...' for a run under secure
    aggregation (its rounds carry `secagg`); None for any other run."""
    secure = [r["secagg"] for r in rounds if r.get("secagg")]
    if not secure:
        return None
    unmasked = sum(1 for r in secure if r["failed"] is None and r["unmasked"])
    dropped = sum(len(r["dropped"]) for r in secure)
    failed = [r["failed"] for r in secure if r["failed"]]
    return (f"{unmasked} of {len(secure)} rounds unmasked, {dropped} devices lost after sharing their keys and "
            "unmasked away" + (f"; {len(failed)} rounds failed (first: {failed[0]})" if failed else ""))


SECAGG_ADVERSARY = ("the coordinator and the broker, malicious, with colluding devices; figures hold whatever "
                    "the colluders' and the lost devices' places on the ring (worst case), lost_at_random is "
                    "a union bound of 1e-6")
"""What the report's `secagg` figures are against (docs/PRIVACY.md, "The threat model")."""


def secagg_report(settings: SecAggSettings, rounds: list[dict[str, Any]], *, sharded: bool) -> dict[str, Any]:
    """The report's `secagg`: for each number of devices a group masked among (a round's selected
    devices, or, sharded, a shard's), the degree k and threshold t it used and what they withstand
    (edge_sdk.secagg.bounds), with the rounds it holds for."""
    from ..rounds.secagg import MIN_PARTICIPANTS  # cryptography loads with a secure run only

    played: dict[int, list[int]] = {}
    for record in rounds:
        secure = record.get("secagg")
        for devices in (secure.get("groups") or [secure["selected"]]) if secure else ():
            if devices >= MIN_PARTICIPANTS and record["round"] not in played.get(devices, []):
                played.setdefault(devices, []).append(record["round"])
    figures = []
    for devices, numbers in sorted(played.items()):
        degree = settings.degree_for(devices)
        bounds = tolerance(devices, degree, settings.threshold_for(degree), settings.secagg_threshold)
        figures.append({**bounds.to_plain(), "rounds": numbers})
    return {"adversary": SECAGG_ADVERSARY, "sharded": sharded, "by_devices": figures}


def secagg_bounds_line(secagg: dict[str, Any]) -> str | None:
    """'n 10, k 9, t 6: hidden from the coordinator with up to 2 colluding devices ...' for the
    report's `secagg` (the smallest round's figures, which are the weakest); None without figures."""
    if not secagg.get("by_devices"):
        return None
    weakest = min(secagg["by_devices"], key=lambda f: (f["colluders"], f["lost"]))
    return (f"n {weakest['devices']}, k {weakest['degree']}, t {weakest['threshold']}: each update hidden from a "
            f"malicious coordinator with up to {weakest['colluders']} colluding devices "
            f"({weakest['colluders_protocol_followed']} if it follows the protocol); the sum unmasks with up to "
            f"{weakest['lost']} lost or silent ({weakest['lost_at_random']} lost at random)")


def privacy_line(privacy: dict[str, Any]) -> str:
    """'dp central: epsilon 7.98 at delta 1e-05 (8.0 budget) ...' for a report's `privacy`."""
    fmt = lambda v: "inf" if v is None else f"{v:.3g}"  # noqa: E731  (None: no finite bound)
    line = (f"dp {privacy['mode']}: epsilon {fmt(privacy['epsilon'])} at delta {privacy['delta']:.2g}"
            + (f" of a {privacy['budget']:g} budget" if privacy.get("budget") else "")
            + f", noise multiplier {privacy['noise_multiplier']:.3g}, clip {privacy['clip']:g}")
    if privacy["mode"] == "central":
        line += f"; against the other devices (who see the selections) {fmt(privacy['epsilon_fleet'])}"
    elif privacy["mode"] == "distributed":
        line += (f"; against the coordinator and the other devices (who see the selections) "
                 f"{fmt(privacy['epsilon_fleet'])}")
    if privacy.get("randomness") == "the run's seed":
        line += "; noise and selections drawn from the run's seed (holds only against whoever does not know it)"
    if privacy.get("outside_the_guarantee"):
        line += f"; outside the guarantee: {', '.join(privacy['outside_the_guarantee'])}"
    return line


def checked_label_counts(value: Any, examples: int, classes: int) -> tuple[list[int] | None, str | None]:
    """A device's HELLO `label_counts` as (counts, None) when it is a list of `classes` ints >= 0
    summing to the `examples` the device reported, (None, why) when it is not, (None, None) when
    the device reported none."""
    if value is None:
        return None, None
    if not isinstance(value, (list, tuple)) or len(value) != classes:
        size = f"{len(value)} entries" if isinstance(value, (list, tuple)) else type(value).__name__
        return None, f"label_counts must be a list of {classes} counts (the task's classes), got {size}"
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value):
        return None, "label_counts must hold ints >= 0"
    if sum(value) != examples:
        return None, f"label_counts sum to {sum(value)}, not to the {examples} examples reported"
    return [int(c) for c in value], None


def label_skew(histograms: list[list[int]]) -> float | None:
    """How far the devices' label distributions are from the pooled one: the mean over devices of
    the total variation distance (half the L1 distance) between a device's label distribution and
    the distribution of all their examples together; 0 when every device holds the same mix, 1 - 1/K
    for K devices holding a class each (None without histograms)."""
    histograms = [h for h in histograms if sum(h) > 0]
    if not histograms:
        return None
    pooled = [math.fsum(column) for column in zip(*histograms, strict=True)]
    total = math.fsum(pooled)
    distances = [0.5 * math.fsum(abs(c / sum(h) - p / total) for c, p in zip(h, pooled, strict=True))
                 for h in histograms]
    return math.fsum(distances) / len(distances)


def data_report(devices: Iterable[Device], classes: int) -> dict[str, Any]:
    """What the coordinator knows of its devices' data: the example counts they reported in HELLO
    and, from those that reported one, their label histograms (a malformed one is left out,
    logged and counted). Shard aggregators hold no data and are not counted."""
    per_device: dict[str, dict[str, Any]] = {}
    histograms: list[list[int]] = []
    for device in sorted((d for d in devices if d.kind != "aggregator"), key=lambda d: d.client_id):
        counts, malformed = checked_label_counts((device.capabilities or {}).get("label_counts"),
                                                 device.num_examples, classes)
        entry: dict[str, Any] = {"kind": device.kind, "examples": device.num_examples, "labels": counts}
        if EXAMPLES_BUCKET in (device.capabilities or {}):  # secure aggregation: only a bound was said
            entry |= {"examples": None, "examples_at_most": device.num_examples}
        if malformed is not None:
            log.warning("%s: label histogram ignored: %s", device.client_id, malformed)
            entry["labels_malformed"] = malformed
        if counts is not None:
            histograms.append(counts)
        per_device[device.client_id] = entry
    examples = [entry["examples"] for entry in per_device.values() if entry["examples"] is not None]
    bounds = [entry["examples_at_most"] for entry in per_device.values() if "examples_at_most" in entry]
    return {
        "devices": len(per_device),
        "examples": sum(examples),
        **({"examples_at_most": sum(bounds)} if bounds else {}),
        "min_examples": min(examples, default=None),
        "max_examples": max(examples, default=None),
        "labels_reported": len(histograms),
        "labels_malformed": sum("labels_malformed" in entry for entry in per_device.values()),
        "label_counts": [sum(column) for column in zip(*histograms, strict=True)] if histograms else None,
        "label_skew": label_skew(histograms),
        "per_device": per_device,
    }


def data_line(data: dict[str, Any]) -> str:
    """'4 devices, 1797 examples (min 310, max 560), labels reported by 4 (skew 0.12)'."""
    if not data["devices"]:
        return "no device registered"
    if not data["examples"] and data.get("examples_at_most"):  # secure aggregation: powers of two only
        return (f"{data['devices']} devices, at most {data['examples_at_most']} examples (each device's count "
                "rounded up to a power of two), no labels reported")
    if not data["examples"]:  # under DP a device says nothing of its data
        return f"{data['devices']} devices, none reported its examples or labels"
    line = (f"{data['devices']} devices, {data['examples']} examples (min {data['min_examples']}, "
            f"max {data['max_examples']}), labels reported by {data['labels_reported']}")
    if data["label_skew"] is not None:
        line += f" (skew {data['label_skew']:.2f})"
    if data["labels_malformed"]:
        line += f", {data['labels_malformed']} malformed"
    return line


def plot_curves(path: Path, report: dict[str, Any]) -> None:
    """Accuracy and cumulative MB per round; skipped with a log line if matplotlib is absent.
    Rounds that did not aggregate every selected device are marked (aggregated/selected, red
    crosses for rounds that aggregated nothing); the MB curve ends with the run's total."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; %s not written (pip install 'edgepfl[train]')", path)
        return
    rounds = report["rounds"]
    xs = [r["round"] for r in rounds]
    acc = [(r["personalized_accuracy"] or {}).get("mean", float("nan")) for r in rounds]
    epsilons = [(r.get("privacy") or {}).get("epsilon") for r in rounds]
    mb = cumulative_megabytes(report)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(xs, acc, marker="o")
    for x, y, record in zip(xs, acc, rounds, strict=True):
        if record["outcome"] == "aborted":
            left.axvline(x, color="tab:red", alpha=0.3)
            left.annotate("nothing aggregated", (x, 0.02), xycoords=("data", "axes fraction"), color="tab:red",
                          fontsize=7, rotation=90)
        elif record["participants"] < record["selected"]:
            left.annotate(f"{record['participants']}/{record['selected']}", (x, y), textcoords="offset points",
                          xytext=(0, 6), ha="center", color="tab:red", fontsize=7)
    left.set(xlabel="round (red: aggregated/selected where some were not aggregated)",
             ylabel="mean personalized accuracy", title=f"{report['algorithm']} on {report['dataset']}")
    left.grid(alpha=0.3)
    if any(e is not None for e in epsilons):
        spent = left.twinx()
        spent.plot(xs, [float("nan") if e is None else e for e in epsilons], color="tab:green", linestyle="--")
        spent.set_ylabel("epsilon spent (dashed)", color="tab:green")
    right.plot(xs, mb[:-1], marker="o", color="tab:orange")
    last = xs[-1] if xs else 0
    right.plot([last, last + 0.5], [mb[-2] if xs else 0.0, mb[-1]], linestyle=":", marker="s", color="tab:orange")
    right.annotate("run total", (last + 0.5, mb[-1]), textcoords="offset points", xytext=(4, 0), fontsize=7)
    right.set(xlabel="round", ylabel="cumulative MB (up + down published)", title="communication")
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


MAX_PARTICIPATION_LINES = 8
"""Rounds with a participation shortfall listed one by one in the summary; the rest are counted."""


def summary(report: dict[str, Any], out: str) -> str:
    """The figures a run ends with (docs/CONFIGURATION.md, "Report figures", defines each one)."""
    final = report["final"]["personalized_accuracy"]
    comm = report["communication"]
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    played, aggregated = report["rounds_completed"], report.get("rounds_aggregated", report["rounds_completed"])
    shortfalls = [line for line in map(participation_line, report["rounds"]) if line is not None]
    evaluated = report["final"].get("devices_evaluated", len(report["final"]["per_client"]))
    registered = report["final"].get("devices_registered", report["clients"])
    partition = f"{report['partition']}, " if report.get("partition") else ""  # known only when simulated or given
    lines = [
        f"algorithm {report['algorithm']} on {report['dataset']} ({partition}{report['clients']} devices, "
        f"model {report['model']})",
        *([f"data                   {data_line(report['data'])}"] if "data" in report else []),
        f"rounds                 {played} played, {aggregated} aggregated"
        + (f", {played - aggregated} aggregated nothing" if played > aggregated else ""),
        *(f"participation          {line}" for line in shortfalls[:MAX_PARTICIPATION_LINES]),
        *([f"participation          ... and {len(shortfalls) - MAX_PARTICIPATION_LINES} more rounds short of "
           "their selection (metrics.jsonl)"] if len(shortfalls) > MAX_PARTICIPATION_LINES else []),
        f"final evaluation       over {evaluated} of {registered} devices"
        + (", on their validation split (test split unread)" if report.get("evaluated_on") == "validation" else ""),
        f"personalized accuracy  mean {fmt(final['mean'])}  std {fmt(final['std'])}  min {fmt(final['min'])}",
        f"best round mean        {fmt(final.get('best_round_mean'))} (trainers, over the rounds' evaluations)",
        f"global-model accuracy  {fmt(report['final']['global_accuracy'])}",
        f"communication          {comm['bytes_up'] / 1e6:.2f} MB up, {comm['bytes_down'] / 1e6:.2f} MB down published"
        + (f" ({comm['bytes_down_delivered'] / 1e6:.2f} MB delivered)" if "bytes_down_delivered" in comm else ""),
        f"wall time              {report['wall_seconds']:.1f} s",
        f"rejected messages      {sum(report['rejections'].values())}",
        f"outputs                {out}/report.json, {out}/metrics.jsonl, {out}/curves.png",
    ]
    if "privacy" in report:
        lines.insert(-4, f"privacy                {privacy_line(report['privacy'])}")
    secure = secagg_line(report["rounds"])
    if secure is not None:
        lines.insert(-4, f"secure aggregation     {secure}")
    bounds = secagg_bounds_line(report["secagg"]) if "secagg" in report else None
    if bounds is not None:
        lines.insert(-4, f"secure aggregation     {bounds}")
    if "asynchronous" in report:
        lines.insert(-4, f"asynchronous           {async_line(report['asynchronous'])}")
    if "dp_sgd" in report:
        dp_sgd = report["dp_sgd"]
        worst = "-" if dp_sgd["epsilon_max"] is None else f"{dp_sgd['epsilon_max']:.3g}"
        at_most = "at most " if dp_sgd.get("delta_per_device") else ""
        lines.insert(-4, f"dp-sgd                 record-level epsilon up to {worst} at delta {at_most}"
                         f"{dp_sgd['delta']:.2g} ({dp_sgd['devices_reporting']} devices reporting), noise multiplier "
                         f"{dp_sgd['noise_multiplier']:.3g}, clip {dp_sgd['clip']:g}, "
                         f"batches {dp_sgd.get('batches', '-')}")
    if "stopped" in report:
        lines.insert(-4, f"stopped early          {report['stopped']}")
    late = report.get("late_updates") or {}
    if late.get("folded") or late.get("discarded"):
        lines.insert(-3, f"late updates           {late['policy']}: {late['folded']} folded into the next round, "
                         f"{late['discarded']} discarded")
    refusals = report.get("device_refusals") or {}
    if refusals:
        by_reason = ", ".join(f"{reason}: {count}" for reason, count in refusals.items())
        lines.insert(-1, f"refused by devices     {sum(refusals.values())} requests ({by_reason})")
    return "\n".join(lines)
