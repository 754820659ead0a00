"""The cost of per-device message signing (HMAC-SHA256, `edge_sdk.signing`) for a 1M-parameter update.

    python -m benchmarks.signing [--quick] [--out DIR]

Measures, for an update of 1,000,000 float32 parameters (4 MB) in a model-like layout: a
device sealing it (`Signer.seal` over the encoded pieces) and the coordinator verifying it
(`Verifier.open_message` on the received message), median of `--repeats`; next to them, the wire
encode and decode of the same update. The reference round is measured here too: one local
epoch of the PyTorch MNIST example network (two 3x3 convolutions of 32 and 64 channels, then
9216-100-10: 0.94M parameters) on 600 28x28 examples in batches of 32 with torch on the CPU, the
least a device does in a round (FedAvg's default is one epoch), leaving out the transfers.
Reported: ms per seal and per verify, and (seal + verify) as a percentage of that round; the
target is under 2%. Writes signing.json and signing.md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from edge_sdk import wire
from edge_sdk.protocol import Envelope, Kind
from edge_sdk.signing import KEY_BYTES, Signer, Verifier

from ._machine import machine_info

PARAMETERS = 1_000_000
SHAPES = [(1200, 784), (1200,), (10, 1200), (10,)]  # 952,010 parameters; the rest in one vector


def update() -> Envelope:
    arrays = {f"layer{i}": np.random.default_rng(i).standard_normal(shape).astype(np.float32)
              for i, shape in enumerate(SHAPES)}
    rest = PARAMETERS - sum(a.size for a in arrays.values())
    arrays["rest"] = np.zeros(rest, np.float32)
    return Envelope(Kind.TRAIN_RES, "dev0", run_id="bench", round=1, groups={"shared": arrays},
                    metrics={"num_examples": 600})


def median_ms(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def local_epoch_seconds(repeats: int) -> float:
    """One epoch of a 0.94M-parameter CNN on 600 examples, batch 32, SGD (a round's least work)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(9216, 100), nn.ReLU(), nn.Linear(100, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(600, 1, 28, 28), torch.randint(0, 10, (600,))

    def epoch() -> None:
        for start in range(0, 600, 32):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(inputs[start:start + 32]), targets[start:start + 32])
            loss.backward()
            optimizer.step()

    return median_ms(epoch, repeats) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke test)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats

    key = bytes(range(KEY_BYTES))
    signer, verifier, envelope = Signer(key), Verifier({"dev0": key}), update()
    pieces = wire.encode_pieces(envelope)
    message = b"".join(signer.seal(pieces))
    figures = {
        "parameters": PARAMETERS,
        "update_bytes": len(message),
        "encode_ms": median_ms(lambda: wire.encode_pieces(envelope), repeats),
        "seal_ms": median_ms(lambda: signer.seal(pieces), repeats),
        "verify_ms": median_ms(lambda: verifier.open_message("dev0", message), repeats),
        "decode_ms": median_ms(lambda: wire.decode(verifier.open_message("dev0", message)), repeats),
        "round_seconds": local_epoch_seconds(max(3, repeats // 4)),
    }
    figures["overhead_percent"] = 100 * (figures["seal_ms"] + figures["verify_ms"]) / (1e3 * figures["round_seconds"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "signing.json").write_text(json.dumps({"figures": figures, "machine": machine_info()}, indent=2) + "\n")
    table = "\n".join([
        "| parameters | message MB | seal ms | verify ms | encode ms | verify + decode ms | round s | overhead |",
        "|---|---|---|---|---|---|---|---|",
        f"| {PARAMETERS:,} | {figures['update_bytes'] / 1e6:.2f} | {figures['seal_ms']:.2f} | "
        f"{figures['verify_ms']:.2f} | {figures['encode_ms']:.2f} | {figures['decode_ms']:.2f} | "
        f"{figures['round_seconds']:.2f} | {figures['overhead_percent']:.2f}% |",
    ])
    (out / "signing.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
