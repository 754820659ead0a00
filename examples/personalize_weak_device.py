"""Personalize a weak device without PyTorch: a released body (ONNX) plus the device's own data
give one personal ONNX model (body + head) that runs anywhere ONNX Runtime does.

What `edgepfl lite-client` does when the coordinator releases a body, as a script you can run on
its own, e.g. on a Raspberry Pi with `pip install "edgepfl[lite]"` (numpy, onnx, onnxruntime):

    edgepfl export --run runs/mixed --out body.onnx           # on the server, after training
    python examples/personalize_weak_device.py --body body.onnx --data my_data.npz --head lr \\
        --out personal.onnx

`--data` holds samples of the body's task, of any kind: an .npz with `x` and `y` (images
N,H,W / N,C,H,W / N,H,W,C as uint8 0..255 or float 0..1; signals N,C,L; feature vectors N,D),
a CSV with a header row and a `label` column (feature vectors), or an ImageFolder directory.
They are normalized as the body's metadata says. A quarter of them (seeded) is held out to
report the personal model's accuracy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_sdk.data import load_user_dataset
from edge_sdk.lite.compose import compose
from edge_sdk.lite.features import FeatureExtractor
from edge_sdk.lite.heads import HEADS, fit_head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body", required=True, help="the released body (edgepfl export)")
    parser.add_argument("--data", required=True, help=".npz with x and y, a .csv with a label column, "
                        "or an ImageFolder directory")
    parser.add_argument("--label-column", default=None, help="the CSV's label column (default: label, or y)")
    parser.add_argument("--head", default="lr", choices=[h for h in HEADS if h != "ncm"])
    parser.add_argument("--out", default="personal.onnx")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    body = FeatureExtractor(args.body, providers="CPUExecutionProvider")
    task = body.task()
    if task is None:
        raise SystemExit(f"{args.body}: its metadata does not describe its task (input_shape, normalization, "
                         "class_names); export it with `edgepfl export`")
    try:
        pool = load_user_dataset(args.data, task, label_column=args.label_column)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    x, y = pool.x, pool.y
    order = np.random.default_rng(args.seed).permutation(len(y))
    test, train = order[: len(y) // 4], order[len(y) // 4:]

    features = body.embed(x[train])
    head = fit_head(args.head, features, y[train], num_classes=task.num_classes, seed=args.seed)
    compose(Path(args.body), head.to_onnx(features.shape[1]), args.out, num_classes=task.num_classes,
            metadata={"head": head.kind})

    personal = ort.InferenceSession(args.out, providers=["CPUExecutionProvider"])
    labels = personal.run(["label"], {"input": np.ascontiguousarray(x[test])})[0]
    noun = "images" if task.kind == "image" else "samples"
    print(f"{args.out}: {head.kind} head on {len(train)} {noun}, accuracy {np.mean(labels == y[test]):.3f} "
          f"on {len(test)} held-out {noun}; outputs 'label' and 'probabilities'")


if __name__ == "__main__":
    main()
