"""What a run leaves in `--out` besides its state: the metrics log (one line per round), the
report and its curves (file names in `RunFolder`)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Iterable

from edge_sdk.store import write_atomic

from .run_folder import RunFolder

log = logging.getLogger(__name__)


def summarize(values: Iterable[float]) -> dict[str, float] | None:
    """Mean, std and min over devices (None when there are none)."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return None
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
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


def plot_curves(path: Path, report: dict[str, Any]) -> None:
    """Accuracy and cumulative MB per round; skipped with a log line if matplotlib is absent."""
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
    mb, total = [], 0.0
    for r in rounds:
        total += (r["bytes_up"] + r["bytes_down"]) / 1e6
        mb.append(total)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(xs, acc, marker="o")
    left.set(xlabel="round", ylabel="mean personalized accuracy", title=f"{report['algorithm']} on {report['dataset']}")
    left.grid(alpha=0.3)
    right.plot(xs, mb, marker="o", color="tab:orange")
    right.set(xlabel="round", ylabel="cumulative MB (up + down)", title="communication")
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
