"""Robust aggregation against 20% adversarial devices (sign flip x10, Gaussian noise, NaN).

digits, 15 devices (3 adversaries with `--attack mixed`), FedAvg, 5 rounds, seed 3, over MQTT:
the plain mean with and without adversaries, then coordinate-wise median and trimmed mean
(and clipping) with them. Writes robustness.json and robustness.md to --out.

    python -m benchmarks.robustness [--quick] [--broker mqtt://127.0.0.1:1883] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from coordinator.config.run_config import RunConfig
from coordinator.hosting.simulate import run_simulation

from .flags import add_output_flags, add_run_flags

SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("mean, no adversaries", {}),
    ("mean, 20% adversaries", {"adversaries": 3, "attack": "mixed"}),
    ("median, 20% adversaries", {"adversaries": 3, "attack": "mixed", "aggregation": "median"}),
    ("trimmed mean 0.2, 20% adversaries", {"adversaries": 3, "attack": "mixed", "aggregation": "trimmed_mean"}),
    ("mean + clip 5, 20% adversaries", {"adversaries": 3, "attack": "mixed", "clip_norm": 5.0}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "2 rounds")
    add_run_flags(parser, (), {})
    args = parser.parse_args()
    out = Path(args.out)
    rows = []
    for index, (name, settings) in enumerate(SETTINGS):
        config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=15, rounds=2 if args.quick else 5, seed=3,
                              broker=args.broker, workers=2, out=str(out / "robustness" / f"setting{index}"),
                              **settings)
        report = run_simulation(config)
        rows.append({"setting": name, "accuracy": report["final"]["personalized_accuracy"]["mean"],
                     "rejections": report["rejections"]})
    out.mkdir(parents=True, exist_ok=True)
    (out / "robustness.json").write_text(json.dumps(rows, indent=2))
    lines = ["| aggregation | mean personalized accuracy | rejected uploads |", "|---|---|---|"]
    lines += [f"| {r['setting']} | {r['accuracy']:.3f} | {sum(r['rejections'].values())} |" for r in rows]
    (out / "robustness.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
