"""Edge path: ONNX Runtime against PyTorch eager, int8 size and accuracy, head fitting times.

For cnn28 and mobilenet_v3_small on Fashion-MNIST (28x28x1):
1. a body trained briefly with a linear head (centrally, `--train-examples` images, `--epochs`
   epochs, then its BatchNorm statistics recomputed on 2,048 of them, as RepPer's devices do:
   the point is a realistic body for quantization, not a good model), exported with
   `export.onnx_export.export_module` (checked against PyTorch) and quantized to int8 with
   `export.quantize.quantize_int8` (static QDQ, per channel, 256 calibration images);
2. file sizes and the int8/fp32 ratio; the accuracy change of int8 = a logistic-regression
   probe fitted on fp32 features of 2,000 held-out images, scored on 2,000 others with
   fp32 and with int8 features;
3. feature extraction latency at batch 1, one thread each: PyTorch eager (`torch.no_grad`,
   eval mode) against ONNX Runtime (CPU provider, fp32 and int8), median of `--repeats` runs;
4. head fitting time on 2,000 x 512 real features (the fp32 cnn28 body's, of the probe's training
   images; on one core): svm, lr, mlp, ncm of
   `edge_sdk.lite.heads.fit_head`.
Writes edge.json and edge.md to --out. Full run (about 10 minutes on 2 cores):

    python -m benchmarks.edge --out benchmarks/results

`--quick` uses 8x8 digits and cnn8 only, fewer images and repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from threadpoolctl import threadpool_limits
from torch import nn

from ._machine import machine_info
from edge_sdk.data import load_dataset
from edge_sdk.lite.heads import HEADS, fit_head
from edge_sdk.models import build_model
from edge_sdk.training import recalibrate_batchnorm
from export.onnx_export import export_module
from export.quantize import quantize_int8

CALIBRATION_EXAMPLES = 2048
"""Images over which the trained body's BatchNorm statistics are recomputed."""


def train_briefly(model: nn.Module, x: np.ndarray, y: np.ndarray, epochs: int, batch: int = 64) -> None:
    """A few epochs of SGD with a linear head, then BatchNorm statistics recomputed on `x`.

    The recalibration matters: torchvision's MobileNetV3 uses BatchNorm momentum 0.01, so after
    a short training its running statistics still lag far behind the weights, the eval-mode
    features hardly vary between inputs (std ~0.002 on offsets ~0.1), and int8 rounding then
    erases most of what varies (measured: -13 points after one epoch without recalibration)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    generator = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y) - 1, batch):
            idx = order[start:start + batch]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            optimizer.step()
    recalibrate_batchnorm(model, xt[:CALIBRATION_EXAMPLES])
    model.eval()


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def median_ms(run, repeats: int) -> float:
    for _ in range(max(5, repeats // 10)):
        run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def features(sess: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
    return np.concatenate([sess.run(["features"], {"input": x[i:i + 256]})[0] for i in range(0, len(x), 256)])


def probe(train: np.ndarray, y_train: np.ndarray, tests: dict[str, np.ndarray], y_test: np.ndarray) -> dict:
    """Accuracy on each of `tests` of the weak devices' `lr` head fitted on `train`."""
    model = fit_head("lr", train, y_train, num_classes=int(max(y_train.max(), y_test.max())) + 1)
    return {name: float(np.mean(model.predict(f) == y_test)) for name, f in tests.items()}


def measure_model(name: str, dataset: str, args, workdir: Path) -> tuple[dict, tuple[np.ndarray, np.ndarray]]:
    """The model's row of the table, and its fp32 features and labels of the probe's training images."""
    data = load_dataset(dataset)
    task = data.task
    rng = np.random.default_rng(0)
    order = rng.permutation(len(data.y))
    n_probe = min(2000, len(order) // 4)
    train_idx, probe_train, probe_test = (order[:args.train_examples], order[-2 * n_probe:-n_probe], order[-n_probe:])
    model = build_model(name, task, seed=0)
    train_briefly(model, data.x[train_idx], data.y[train_idx], args.epochs)
    body = model.body.eval()
    shape = task.input_shape
    fp32 = export_module(body, shape, workdir / f"{name}.onnx", metadata={"model": name, "dataset": dataset},
                         check_inputs=data.x[probe_test[:256]])
    int8 = quantize_int8(fp32.path, workdir / f"{name}.int8.onnx", data.x[train_idx[:256]])
    s32, s8 = session(fp32.path), session(int8.path)
    train_features = features(s32, data.x[probe_train])
    accuracy = probe(train_features, data.y[probe_train],
                     {"fp32": features(s32, data.x[probe_test]), "int8": features(s8, data.x[probe_test])},
                     data.y[probe_test])
    one = data.x[probe_test[:1]]
    torch.set_num_threads(1)
    with torch.no_grad():
        eager = median_ms(lambda: body(torch.from_numpy(one)), args.repeats)
    ort32 = median_ms(lambda: s32.run(["features"], {"input": one}), args.repeats)
    ort8 = median_ms(lambda: s8.run(["features"], {"input": one}), args.repeats)
    row = {
        "model": name, "dataset": dataset, "max_abs_diff_vs_torch": fp32.max_abs_diff,
        "fp32_bytes": fp32.size_bytes, "int8_bytes": int8.size_bytes, "int8_ratio": int8.ratio_to_fp32,
        "probe_accuracy_fp32": accuracy["fp32"], "probe_accuracy_int8": accuracy["int8"],
        "accuracy_change_points": 100 * (accuracy["int8"] - accuracy["fp32"]),
        "latency_ms_batch1": {"torch_eager": eager, "onnxruntime_fp32": ort32, "onnxruntime_int8": ort8},
        "speedup_onnxruntime_fp32": eager / ort32, "speedup_onnxruntime_int8": eager / ort8,
    }
    return row, (train_features, data.y[probe_train])


def head_times(x: np.ndarray, labels: np.ndarray, repeats: int) -> dict:
    """Median seconds to fit each head on real features `x` [N, d] (a body's, as a weak device
    sees them), on one core."""
    times = {}
    with threadpool_limits(1):
        for kind in HEADS:
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                fit_head(kind, x, labels, num_classes=int(labels.max()) + 1)
                runs.append(time.perf_counter() - started)
            times[kind] = statistics.median(runs)
    return times


def markdown(result: dict) -> str:
    lines = ["| model | fp32 KB | int8 KB | int8/fp32 | probe acc. fp32 | int8 | change (points) | "
             "batch-1 ms: torch eager | ORT fp32 | ORT int8 | ORT fp32 speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in result["models"]:
        lat = m["latency_ms_batch1"]
        lines.append(f"| {m['model']} ({m['dataset']}) | {m['fp32_bytes'] / 1e3:.0f} | {m['int8_bytes'] / 1e3:.0f} "
                     f"| {m['int8_ratio']:.3f} | {m['probe_accuracy_fp32']:.4f} | {m['probe_accuracy_int8']:.4f} "
                     f"| {m['accuracy_change_points']:+.2f} | {lat['torch_eager']:.3f} | {lat['onnxruntime_fp32']:.3f} "
                     f"| {lat['onnxruntime_int8']:.3f} | {m['speedup_onnxruntime_fp32']:.2f}x |")
    heads = result["head_fit_seconds"]
    lines += ["", f"Head fitting on {result['head_examples']} x {result['head_dim']} features of "
                  f"{result['head_features']} "
              "(the probe's training images), one core:", "",
              "| head | seconds |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in heads.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="digits and cnn8 only, fewer repeats")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--train-examples", type=int, default=12000)
    parser.add_argument("--epochs", type=int, default=3, help="training epochs of each body before export")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.train_examples, args.epochs = 50, 1000, 1
    models = [("cnn8", "digits")] if args.quick else [("cnn28", "fmnist"), ("mobilenet_v3_small", "fmnist")]
    with tempfile.TemporaryDirectory() as tmp:
        measured = [measure_model(name, dataset, args, Path(tmp)) for name, dataset in models]
    rows = [row for row, _ in measured]
    head_x, head_y = measured[0][1]  # the first model's features (cnn28's 512 on Fashion-MNIST)
    result = {"machine": machine_info(), "models": rows, "head_dim": head_x.shape[1], "head_examples": len(head_x),
              "head_features": f"{models[0][0]} on {models[0][1]}", "head_fit_seconds": head_times(head_x, head_y, 3)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "edge.json").write_text(json.dumps(result, indent=2))
    (out / "edge.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
