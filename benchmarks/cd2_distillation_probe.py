"""One Fashion-MNIST `domains` device trained alone with CD2-pFed's loss in several forms.

Device `--index` of 10 (`domains`, seed 0; index 0 sees its images rotated), its first `--examples`
training images, `--rounds` rounds of one local epoch (p_t and the EMA follow the rounds as in a
federation; nothing is averaged). For each form it prints the full network's test accuracy, the
shared sub-network g_w0's (`global_accuracy`) and the mean entropy of g_w0's prediction on the
test split (ln 10 = 2.30 is uniform). Forms: the module's `distillation` values at a lambda
(`cyclic+inplace:1`, `inplace:1`, `cyclic:1`, `cyclic:0` = no distillation) and `labels:LAM`, a
candidate not adopted: Eq. (4) plus the label loss on both sub-networks.

    python -m benchmarks.cd2_distillation_probe --rounds 10 --examples 2000 cyclic:1 cyclic:0 inplace:1 \\
        cyclic+inplace:1 labels:1 labels:0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, cast

import torch
import torch.nn.functional as F

from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.cd2_pfed import CD2PFedDevice, Hyper, cyclic_distillation
from edge_sdk.data import load_client_data
from edge_sdk.settings import TrainSettings
from edge_sdk.training import LossFn, eval_mode


class LabelsCandidate(CD2PFedDevice):
    """The `labels` candidate: CD2-pFed whose local objective is the CE of the full network and
    of both sub-networks + lam * Eq. (4). A subclass overriding `local_loss`, the objective hook
    every algorithm defines: the rest (masks, schedule, EMA, evaluation) is CD2-pFed's own."""

    def local_loss(self, task: Task) -> LossFn:
        masks = self.masks(task.round)
        keep_shared = {k: (~m).to(torch.float32) for k, m in masks.items()}
        keep_personal = {k: m.to(torch.float32) for k, m in masks.items()}
        scratch = {k: v.clone() for k, v in self.gw0_stats.items()}
        lam = self.hyper.lam

        def loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            logits_global = self.subnet_logits(xb, keep_shared, self.gw0_stats)
            logits_local = self.subnet_logits(xb, keep_personal, scratch)
            ce = sum(F.cross_entropy(logits, yb) for logits in (self.model(xb), logits_global, logits_local))
            return ce + lam * cyclic_distillation(logits_local, logits_global)

        return loss


def probe(form: str, lam: float, args: argparse.Namespace) -> dict:
    data = load_client_data("fmnist", num_clients=10, index=args.index, partition="domains", seed=0,
                            data_dir=args.data_dir)
    data.train_x, data.train_y = data.train_x[:args.examples], data.train_y[:args.examples]
    settings = TrainSettings("auto", args.rounds, local_epochs=1, batch_size=32, lr=0.05, seed=0)
    # a form from the command line: Hyper refuses one that is not a DISTILLATIONS name
    hyper = Hyper(lam=lam) if form == "labels" else Hyper(lam=lam, distillation=cast(Any, form))
    device_class = LabelsCandidate if form == "labels" else CD2PFedDevice
    device = device_class(hyper, settings, data, "cpu", client_seed=100 + args.index)
    started = time.monotonic()
    for round_ in range(1, args.rounds + 1):
        device.train_locally(Task(round_, {}, {}))
    metrics = device.evaluate(Task(args.rounds, {}, {}))
    keep_shared = {k: (~m).to(torch.float32) for k, m in device.masks(args.rounds).items()}
    with eval_mode(device.model), torch.no_grad():
        logits = device.subnet_logits(device.test_x, keep_shared, device.gw0_stats)
        entropy = float(-(logits.softmax(1) * logits.log_softmax(1)).sum(1).mean())
    return {"form": form, "lam": lam, "accuracy": round(metrics["accuracy"], 4),
            "global_accuracy": round(metrics["global_accuracy"], 4), "shared_entropy": round(entropy, 3),
            "seconds": round(time.monotonic() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--examples", type=int, default=2000, help="leading training examples of the device")
    parser.add_argument("--index", type=int, default=0, help="the device (of 10)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("forms", nargs="+", help="FORM:LAMBDA, FORM one of cyclic+inplace, inplace, cyclic, labels")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for spec in args.forms:
        form, lam = spec.rsplit(":", 1)
        print(json.dumps(probe(form, float(lam), args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
