"""Your own model on your own data: two user networks trained with FedAvg, FedRep and RepPer over MQTT.

1. A tabular task: a CSV file with a label column (scikit-learn's breast-cancer measurements
   written out as a user would have them) and a hand-written `nn.Sequential` MLP.
2. Non-square RGB images (digits drawn at 40x32 pixels in a random colour) and torchvision's
   `mobilenet_v3_small` with a new 10-class head.

Neither network is in edgepfl's registry: each is a factory `factory(task) -> nn.Module` whose
split into body and head is declared once with `edge_sdk.models.split`. `Federation` runs the
embedded broker, the coordinator and every device in this process, each device with its own
MQTT connection. RepPer then releases its body as ONNX: a weak device (ONNX Runtime and a numpy
head, no PyTorch) personalizes on it inside the run, and the body is exported again as int8.

    python examples/bring_your_model.py [--devices 10] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path

import numpy as np
from torch import nn

from coordinator.commands.export import export_run
from coordinator.federation import Federation
from edge_sdk.models import split

ALGORITHMS = ("fedavg", "fedrep", "repper")


def tabular_mlp(task):
    """A user's MLP for feature vectors: its last layer is the head."""
    return split(nn.Sequential(nn.Linear(task.input_shape[0], 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                               nn.Linear(32, task.num_classes)), head="4")


def small_mobilenet(task):
    """torchvision's MobileNetV3-small (no pretrained weights) with a head for the task's classes."""
    from torchvision.models import mobilenet_v3_small

    return split(mobilenet_v3_small(weights=None, num_classes=task.num_classes), head="classifier.3")


def write_csv(path: Path) -> Path:
    """The breast-cancer measurements as a user's CSV: one column per feature, then `label`."""
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*(name.replace(" ", "_") for name in bunch.feature_names), "label"])
        for row, label in zip(bunch.data, bunch.target_names[bunch.target]):
            writer.writerow([*(f"{v:.6g}" for v in row), label])
    return path


def coloured_digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Digits drawn at 40x32 pixels (H x W) in a random colour: uint8 [N, 40, 32, 3] and labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows, cols = np.arange(40) * 8 // 40, np.arange(32) * 8 // 32
    gray = (digits.images / 16.0)[:, rows][:, :, cols]
    colours = np.random.default_rng(seed).uniform(0.3, 1.0, size=(len(gray), 1, 1, 3))
    return (gray[..., None] * colours * 255).astype(np.uint8), digits.target


def summary(label: str, report: dict) -> str:
    final = report["final"]["personalized_accuracy"]
    kinds = report["final"].get("by_kind") or {}
    weak = kinds.get("lite")
    weak_text = f", weak devices {weak['mean']:.3f}" if weak else ""
    return (f"{label} {report['algorithm']}: mean personalized accuracy {final['mean']:.3f} over "
            f"{len(report['final']['per_client'])} devices{weak_text}, "
            f"{report['communication']['bytes_up'] / 1e6:.2f} MB up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="4 devices, 2 rounds, the image task with FedAvg only")
    parser.add_argument("--broker", help="mqtt://host:port of a running broker (default: start amqtt here)")
    args = parser.parse_args()
    devices, rounds = (4, 2) if args.quick else (args.devices, args.rounds)
    common = {"clients": devices, "rounds": rounds, "partition": "dirichlet", "alpha": 0.5, "quorum_grace": 0.0,
              "device": "cpu",
              **({"broker": args.broker} if args.broker else {})}

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        table = write_csv(work / "breast_cancer.csv")
        for algorithm in ALGORITHMS:
            weak = {"lite_fraction": 0.25, "head": "lr"} if algorithm == "repper" else {}
            trainers = devices - round(devices * weak.get("lite_fraction", 0))
            report = Federation(model=tabular_mlp, data=table, algorithm=algorithm, min_clients=trainers,
                                out=str(work / f"tabular-{algorithm}"), **weak, **common).run()
            print(summary("tabular", report))
        exported = export_run(work / "tabular-repper", work / "tabular-body.int8.onnx", quantize="int8")
        print(f"tabular repper body: {exported['size_bytes']} bytes int8 at {Path(exported['path']).name}, "
              f"max |ONNX - PyTorch| {exported['max_abs_diff']:.2e} (fp32), {exported['int8']['left_in_float_text']}")

        images = coloured_digits()
        for algorithm in ALGORITHMS[:1] if args.quick else ALGORITHMS:
            report = Federation(model=small_mobilenet, data=images, algorithm=algorithm, min_clients=devices,
                                out=str(work / f"images-{algorithm}"), **common).run()
            print(summary("images 40x32 RGB", report))


if __name__ == "__main__":
    main()
