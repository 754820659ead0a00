"""Every algorithm on user models: a tabular MLP and a small CNN on non-square RGB images.

Two networks that are not in edgepfl's registry, each a factory with its split declared by
`edge_sdk.models.split`: an `nn.Sequential` MLP on scikit-learn's breast-cancer measurements
(30 features, 2 classes), and a CNN on digits drawn at 24x16 pixels (H x W) in a random colour
per image. Each of the 12 algorithms runs on each (10 devices, Dirichlet 0.5, 5 rounds, seed 0,
through `Federation`: the embedded broker and every device in this process, over MQTT), or is
refused at start with the capability it misses; the table says which, with the accuracy.

    python -m benchmarks.user_models [--quick] [--broker mqtt://127.0.0.1:1883] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from .flags import add_output_flags, add_run_flags
from ._machine import machine_info
from coordinator.federation import Federation
from edge_sdk.algorithms import in_table_order
from edge_sdk.models import ModelError, split


def tabular_mlp(task):
    """A user's MLP for feature vectors; its last layer is the head."""
    return split(nn.Sequential(nn.Linear(task.input_shape[0], 64), nn.ReLU(), nn.Linear(64, task.num_classes)),
                 head="2")


def image_cnn(task):
    """A user's CNN for images of any H x W (adaptive pooling); its last layer is the head."""
    return split(nn.Sequential(nn.Conv2d(task.channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                               nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                               nn.AdaptiveAvgPool2d((3, 2)), nn.Flatten(), nn.Linear(192, task.num_classes)),
                 head="9")


def rgb_digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Digits at 24x16 pixels (each pixel repeated 3 x 2 times), tinted: uint8 [N, 24, 16, 3]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    enlarged = np.kron(digits.images / 16.0, np.ones((1, 3, 2)))
    tint = np.random.default_rng(seed).uniform(0.3, 1.0, size=(len(enlarged), 1, 1, 3))
    return np.round(enlarged[..., None] * tint * 255).astype(np.uint8), digits.target


TASKS: dict[str, tuple[Callable[..., nn.Module], dict[str, Any]]] = {
    "tabular MLP (breast_cancer, 30 features)": (tabular_mlp, {"dataset": "breast_cancer"}),
    "CNN on 24x16 RGB images (digits)": (image_cnn, {"data": rgb_digits()}),
}


def run(algorithm: str, factory, source: dict, rounds: int, clients: int, out: Path, broker: str | None) -> dict:
    """One run's row: accuracy and bytes, or the refusal's message."""
    started = time.monotonic()
    given_broker: dict[str, Any] = {"broker": broker} if broker else {}
    try:
        report = Federation(model=factory, algorithm=algorithm, clients=clients, rounds=rounds,
                            partition="dirichlet", alpha=0.5, seed=0, min_clients=clients, quorum_grace=0.0,
                            device="cpu", out=str(out), **given_broker, **source).run()
    except ModelError as exc:
        return {"algorithm": algorithm, "refused": str(exc)}
    final = report["final"]["personalized_accuracy"]
    return {"algorithm": algorithm, "mean": final["mean"], "min": final["min"],
            "global": report["final"]["global_accuracy"],
            "mb_up": report["communication"]["bytes_up"] / 1e6, "seconds": time.monotonic() - started}


def markdown(results: dict[str, list[dict]], rounds: int, clients: int) -> str:
    lines = [f"{clients} devices, Dirichlet 0.5, {rounds} rounds, seed 0 "
             "(personalized accuracy: mean over devices)", ""]
    header = " | ".join(results)
    lines += [f"| algorithm | {header} |", "|---" * (len(results) + 1) + "|"]
    for rows in zip(*results.values(), strict=True):  # one algorithm's row in every task
        cells = [f"refused: {row['refused']}" if "refused" in row else
                 f"{row['mean']:.3f} (min {row['min']:.3f}, {row['mb_up']:.1f} MB up)" for row in rows]
        lines.append(f"| {rows[0]['algorithm']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "3 devices, 1 round, repper only")
    add_run_flags(parser, (), {})
    args = parser.parse_args()
    rounds, clients = (1, 3) if args.quick else (5, 10)
    algorithms = ("repper",) if args.quick else tuple(cls.id for cls in in_table_order())
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as work:
        for label, (factory, source) in TASKS.items():
            results[label] = []
            for algorithm in algorithms:
                row = run(algorithm, factory, source, rounds, clients, Path(work) / f"{factory.__name__}-{algorithm}",
                          args.broker)
                results[label].append(row)
                print(label, json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "user_models.json").write_text(json.dumps({"machine": machine_info(), "rounds": rounds,
                                                       "clients": clients, "results": results}, indent=2))
    (out / "user_models.md").write_text(markdown(results, rounds, clients))
    print(markdown(results, rounds, clients))


if __name__ == "__main__":
    main()
