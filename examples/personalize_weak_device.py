"""Personalize a weak device without PyTorch: a released body (ONNX) plus the device's own images
give one personal ONNX model (body + head) that runs anywhere ONNX Runtime does.

What `edgepfl lite-client` does when the coordinator releases a body, as a script you can run on
its own, e.g. on a Raspberry Pi with `pip install "edgepfl[lite]"` (numpy, onnx, onnxruntime):

    edgepfl export --run runs/mixed --out body.onnx           # on the server, after training
    python examples/personalize_weak_device.py --body body.onnx --data my_images.npz --head lr \\
        --out personal.onnx

`--data` is an .npz with `x` (N,H,W / N,C,H,W / N,H,W,C; uint8 0..255 or float 0..1) and `y`
(labels), or an ImageFolder directory; the images are normalized as the body's metadata says.
A quarter of them (seeded) is held out to report the personal model's accuracy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_sdk.data.folder import read_folder
from edge_sdk.lite.compose import compose
from edge_sdk.lite.features import FeatureExtractor
from edge_sdk.lite.heads import HEADS, fit_head


def normalized(x01: np.ndarray, normalization: dict) -> np.ndarray:
    """Pixels in [0, 1] -> the body's input: per channel (x - mean) / std."""
    mean = np.asarray(normalization["mean"], np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(normalization["std"], np.float32).reshape(1, -1, 1, 1)
    return ((x01 - mean) / std).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body", required=True, help="the released body (edgepfl export)")
    parser.add_argument("--data", required=True, help=".npz with x and y, or an ImageFolder directory")
    parser.add_argument("--head", default="lr", choices=[h for h in HEADS if h != "ncm"])
    parser.add_argument("--out", default="personal.onnx")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    body = FeatureExtractor(args.body, providers="CPUExecutionProvider")
    x01, y, _ = read_folder(args.data, None)
    if body.input_shape is not None and x01.shape[1:] != body.input_shape:
        raise SystemExit(f"{args.data}: images are {list(x01.shape[1:])}, the body takes {list(body.input_shape)}")
    x = normalized(x01, body.metadata["normalization"])
    order = np.random.default_rng(args.seed).permutation(len(y))
    test, train = order[: len(y) // 4], order[len(y) // 4:]

    num_classes = len(body.metadata.get("class_names") or []) or int(y.max()) + 1
    features = body.embed(x[train])
    head = fit_head(args.head, features, y[train], num_classes=num_classes, seed=args.seed)
    compose(Path(args.body), head.to_onnx(features.shape[1]), args.out, num_classes=num_classes,
            metadata={"head": head.kind})

    personal = ort.InferenceSession(args.out, providers=["CPUExecutionProvider"])
    labels = personal.run(["label"], {"input": x[test]})[0]
    print(f"{args.out}: {head.kind} head on {len(train)} images, accuracy {np.mean(labels == y[test]):.3f} "
          f"on {len(test)} held-out images; outputs 'label' and 'probabilities'")


if __name__ == "__main__":
    main()
