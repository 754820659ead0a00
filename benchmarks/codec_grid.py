"""Upload codecs x personalization algorithms in one setting: MB to accuracy, and what federation costs.

A part of benchmarks/communication.py (`--grid`): every (algorithm, codec) of --grid-algorithms x
--grid-codecs, plus Local once (no communication), from cached runs (`RunCache`). For each: MB up
and MB down delivered (the TRAIN broadcast times the devices, as the broker sends it out; the
grid's runs keep `downlink_codec` full unless the command sets it), total MB, rounds and MB until
the run first reaches 95% of its algorithm's own fp32 final accuracy, final mean personalized
accuracy, and the devices' CPU seconds per round spent encoding uploads. The report has no encoding
time: `encode_seconds` times `edge_sdk.codecs.encode` on the run's model with a random change
from the broadcast, scaled to the share of the model the algorithm uploads. An algorithm that
refuses lossy codecs (DC-PFL) shows the coordinator's reason in its row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .runs import NAMES, RunCache, RunView

GRID_ALGORITHMS = ("fedavg", "fedavg_ft", "fedrep", "fedbabu", "repper", "dc_pfl")
GRID_CODECS = ("fp32", "int8", "q4", "topk")
FIRST = (("fedavg", "fp32"), ("fedavg_ft", "fp32"), ("fedavg_ft", "q4"), ("fedavg_ft", "topk"), ("local", "fp32"))
"""The most informative cells, trained first (then the fp32 references, then the rest in table order)."""
log = logging.getLogger("benchmarks")

OWN_SHARE = 0.95
"""Each row's target: this share of its algorithm's own fp32 final accuracy."""
GOAL_SLACK = 0.005
"""The goal: FedAvg+FT's fp32 final accuracy within half a point..."""
GOAL_RATIO = 0.1
"""...with at most a tenth of FedAvg fp32's total MB to that accuracy."""


def refusal(algorithm: str, codec: str) -> str | None:
    """Why the coordinator refuses `codec` for `algorithm` before a run starts (None: it takes it)."""
    from coordinator import algorithms
    from coordinator.aggregation.validation import check_upload_codec
    from coordinator.config.run_config import ConfigError

    try:
        check_upload_codec(codec, algorithms.load(algorithm))
    except ConfigError as exc:
        return str(exc).split(": ", 2)[-1]
    return None


def curve(view: RunView) -> list[tuple[int, float, float, float]]:
    """(round, cumulative MB up, cumulative MB down delivered, mean personalized accuracy) per evaluated round."""
    report = view.report
    participants = sum(r["participants"] for r in report["rounds"]) or 1
    per_device_up = report["communication"]["by_kind"]["up"].get("train_res", 0) / participants
    down = view.traffic()["down_train_delivered"]
    points, up_total, down_total = [], 0.0, 0.0
    for record in view.records:
        up_total += record["participants"] * per_device_up
        down_total += down
        mean = (record["personalized_accuracy"] or {}).get("mean")
        if mean is not None:
            points.append((record["round"], up_total / 1e6, down_total / 1e6, mean))
    return points


def first_reaching(points: list[tuple[int, float, float, float]], target: float) -> dict[str, Any] | None:
    """The first point of `curve` at or above `target`: its round and total MB (None: never)."""
    for round_, up, down, mean in points:
        if mean >= target:
            return {"round": round_, "mb": up + down, "accuracy": mean}
    return None


def encode_seconds(view: RunView, codec: str, repeats: int = 3) -> float:
    """CPU seconds one device spends encoding its whole model under `codec`: `edge_sdk.codecs.encode`
    on the run's model (as the broadcast) and that model plus a random change of 1e-3 per weight
    (the update), the fastest of `repeats`. fp32 costs 0 (nothing to encode)."""
    if codec == "fp32":
        return 0.0
    import torch

    from edge_sdk import codecs
    from edge_sdk.codecs import rounding_generator
    from edge_sdk.models import build_model
    from edge_sdk.sparse_codec import Residuals

    model = build_model(view.config.model_name, view.config.task(), seed=0)
    received = {"model": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()
                          if v.dtype == torch.float32}}
    rng = np.random.default_rng(0)
    update = {"model": {k: (v + rng.normal(0, 1e-3, v.shape)).astype(np.float32) for k, v in received["model"].items()}}
    best = float("inf")
    for _ in range(repeats):
        residuals = Residuals()
        started = time.process_time()
        codecs.encode(codecs.UploadCodec(codec, view.config.training.topk_fraction), update, received,
                      rng=rounding_generator(0, 1, "device-0"), residuals=residuals)
        best = min(best, time.process_time() - started)
    return best


def grid(cache: RunCache, config_for: Callable[..., Any], algorithms: list[str], codec_names: list[str]) -> dict:
    """Train (or read) every cell, FIRST first, and tabulate them; `config_for(algorithm, **extra)`: a config."""
    cells = [(a, c) for a in algorithms for c in codec_names]
    order = [cell for cell in FIRST if cell in cells or cell[0] == "local"]
    order += [cell for cell in cells if cell not in order and cell[1] == "fp32" and cell[0] != "dc_pfl"]
    order += [cell for cell in cells if cell not in order]
    views: dict[tuple[str, str], RunView | None] = {}
    refused: dict[tuple[str, str], str] = {}
    for algorithm, codec in order:
        reason = refusal(algorithm, codec)
        if reason is not None:
            refused[algorithm, codec] = reason
            continue
        view = views[algorithm, codec] = cache.run(config_for(algorithm, upload_codec=codec))
        if view is not None:
            log.info("grid %s %s: %.4f after %d rounds%s", algorithm, codec, view.personalized()["mean"] or 0,
                     view.rounds, " (cached)" if view.cached else f" ({view.seconds:.0f} s)")
    missing = "not run" if cache.cached_only else "failed"
    rows = [cell_row(a, c, views, refused, missing) for a, c in [("local", "fp32"), *cells]]
    return {"rows": rows, "goal": goal(rows), "codecs": codec_names, "algorithms": algorithms}


def cell_row(algorithm: str, codec: str, views: dict, refused: dict, missing: str) -> dict[str, Any]:
    row: dict[str, Any] = {"algorithm": algorithm, "codec": codec}
    if (algorithm, codec) in refused:
        return {**row, "status": "refused", "reason": refused[algorithm, codec]}
    view = views.get((algorithm, codec))
    if view is None:
        return {**row, "status": missing}
    points = curve(view)
    fp32 = views.get((algorithm, "fp32"))
    own_final = fp32.personalized()["mean"] if fp32 is not None else None
    reached = first_reaching(points, OWN_SHARE * own_final) if own_final is not None else None
    traffic = view.traffic()
    per_device = encode_seconds(view, codec)
    fp32_bytes = fp32.traffic()["up_train_per_device"] if fp32 is not None else None
    model_bytes = model_float_bytes(view)
    share = min(1.0, fp32_bytes / model_bytes) if fp32_bytes and model_bytes else 1.0
    participants = sum(r["participants"] for r in view.records) / max(1, len(view.records))
    # the encode time of the whole model, scaled to the share of it the algorithm uploads (fp32 bytes / model bytes)
    return {**row, "status": "ok", "rounds": view.rounds, "run": view.out.name, "seconds": view.run_seconds(),
            "downlink": view.config.training.downlink_codec,
            "mb_up": points[-1][1] if points else 0.0, "mb_down_delivered": points[-1][2] if points else 0.0,
            "mb_up_per_round": traffic["up_train"] / 1e6,
            "mb_down_delivered_per_round": traffic["down_train_delivered"] / 1e6,
            "final_accuracy": view.personalized()["mean"], "own_target": None if own_final is None
            else OWN_SHARE * own_final, "to_own_target": reached,
            "encode_cpu_s_per_round": per_device * share * participants, "uploaded_share": share,
            "curve": points}


def model_float_bytes(view: RunView) -> int:
    import torch

    from edge_sdk.models import build_model

    model = build_model(view.config.model_name, view.config.task(), seed=0)
    return sum(v.numel() * 4 for v in model.state_dict().values() if v.dtype == torch.float32)


def goal(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Does a cell reach FedAvg+FT's fp32 final accuracy (within GOAL_SLACK) with at most GOAL_RATIO
    of FedAvg fp32's total MB to that accuracy?"""
    by = {(r["algorithm"], r["codec"]): r for r in rows if r["status"] == "ok"}
    ft, fedavg = by.get(("fedavg_ft", "fp32")), by.get(("fedavg", "fp32"))
    if ft is None or fedavg is None:
        return {"evaluated": False, "why": "FedAvg fp32 or FedAvg+FT fp32 missing"}
    target = ft["final_accuracy"] - GOAL_SLACK
    reference = first_reaching(fedavg["curve"], target)
    # FedAvg never reaching it: its whole run's MB is a lower bound of what it needs
    reference_mb = reference["mb"] if reference else fedavg["mb_up"] + fedavg["mb_down_delivered"]
    cells = []
    for (algorithm, codec), row in by.items():
        if algorithm == "local":
            continue
        reached = first_reaching(row["curve"], target)
        cells.append({"algorithm": algorithm, "codec": codec, "reached": reached,
                      "ratio": None if reached is None else reached["mb"] / reference_mb})
    hits = sorted((c for c in cells if c["ratio"] is not None), key=lambda c: c["ratio"])
    return {"evaluated": True, "target": target, "fedavg_ft_final": ft["final_accuracy"],
            "fedavg_reached": reference, "fedavg_mb": reference_mb, "budget_mb": GOAL_RATIO * reference_mb,
            "cells": cells, "best": hits[0] if hits else None,
            "met": bool(hits) and hits[0]["ratio"] <= GOAL_RATIO}


# -- outputs ----------------------------------------------------------------------------------
def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def markdown(document: dict[str, Any], setting: str) -> list[str]:
    table = document["grid"]
    lines = [f"## Upload codecs x algorithms: MB to accuracy ({setting})", "",
             "MB up: TRAIN_RES over the run; MB down: the TRAIN broadcast as delivered to every device (the "
             "downlink is the full state in every row: downlink compression is not built); MB to 95%: up + down "
             "until the first round whose mean personalized accuracy reaches 95% of that algorithm's own fp32 "
             "final accuracy; encode CPU: the devices' CPU seconds per round spent encoding uploads (timed "
             "apart, see below).", "",
             "| method | codec | downlink | MB up | MB down (delivered) | MB total | rounds to 95% own fp32 "
             "| MB to 95% | final accuracy | encode CPU s / round |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table["rows"]:
        name = NAMES.get(r["algorithm"], r["algorithm"])
        codec = "-" if r["algorithm"] == "local" else r["codec"]
        if r["status"] == "refused":
            lines.append(f"| {name} | {codec} | - | refused: {r['reason'].split(' (')[0]} | | | | | | |")
            continue
        if r["status"] != "ok":
            lines.append(f"| {name} | {codec} | - | {r['status']} | | | | | | |")
            continue
        reached = r["to_own_target"]
        to_target = reached["round"] if reached else f"not in {r['rounds']}"
        downlink = "control only" if r["algorithm"] == "local" else r.get("downlink", "full")
        lines.append(f"| {name} | {codec} | {downlink} "
                     f"| {_mb(r['mb_up'])} | {_mb(r['mb_down_delivered'])} "
                     f"| {_mb(r['mb_up'] + r['mb_down_delivered'])} "
                     f"| {to_target} "
                     f"| {_mb(reached['mb']) if reached else '-'} | {100 * r['final_accuracy']:.2f} "
                     f"| {r['encode_cpu_s_per_round']:.4f} |")
    lines += ["", goal_markdown(table["goal"]), ""]
    return lines


def goal_markdown(result: dict[str, Any]) -> str:
    if not result["evaluated"]:
        return f"Goal not evaluated: {result['why']}."
    fedavg = result["fedavg_reached"]
    head = (f"**Goal**: some configuration reaches FedAvg+FT's fp32 final accuracy within 0.5 points "
            f"({100 * result['fedavg_ft_final']:.2f}%, so {100 * result['target']:.2f}%) with at most a tenth of "
            f"FedAvg fp32's total MB to that accuracy ("
            + (f"FedAvg fp32 reaches it at round {fedavg['round']} with {result['fedavg_mb']:.2f} MB"
               if fedavg else f"FedAvg fp32 never reaches it: its whole run, {result['fedavg_mb']:.2f} MB, "
               "is a lower bound") + f"; budget {result['budget_mb']:.2f} MB): ")
    best = result["best"]
    if best is None:
        return head + "**not met**: no configuration reaches that accuracy."
    where = (f"{NAMES[best['algorithm']]} {best['codec']}, round {best['reached']['round']}, "
             f"{best['reached']['mb']:.2f} MB = {best['ratio']:.2f}x FedAvg's")
    return head + ("**met**" if result["met"] else "**not met**") + f"; the cheapest that reaches it: {where}."


def plot(path: Path, document: dict[str, Any]) -> None:
    """Mean personalized accuracy against cumulative MB (uploads + delivered broadcasts), one line per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"fp32": "-", "int8": "--", "q4": "-.", "topk": ":"}
    markers = {"fp32": "o", "int8": "s", "q4": "^", "topk": "x"}
    fig, ax = plt.subplots(figsize=(8, 5))
    order = list(document["grid"]["algorithms"])  # a colour per method of this grid, a line style per codec
    for r in document["grid"]["rows"]:
        if r["status"] != "ok":
            continue
        if r["algorithm"] == "local":
            ax.axhline(r["final_accuracy"], color="black", linewidth=1, label="Local (no communication)")
            continue
        xs = [up + down for _, up, down, _ in r["curve"]]
        ys = [mean for *_, mean in r["curve"]]
        ax.plot(xs, ys, color=f"C{order.index(r['algorithm']) % 10}", linestyle=styles.get(r["codec"], "-"),
                marker=markers.get(r["codec"], "."), markersize=3,
                label=f"{NAMES.get(r['algorithm'], r['algorithm'])} {r['codec']}")
    goal_ = document["grid"]["goal"]
    if goal_.get("evaluated"):
        ax.axhline(goal_["target"], color="black", linestyle="--", linewidth=0.8, label="FedAvg+FT fp32 - 0.5 pt")
    ax.set(xlabel="cumulative MB (uploads + TRAIN broadcasts delivered)", ylabel="mean personalized accuracy",
           xscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
