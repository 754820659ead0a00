"""FedBABU (Oh et al., "FedBABU: Towards Enhanced Representation for Federated Image
Classification", ICLR 2022).

Partition: `body` (the extractor) shared, `head` (the last linear classifier) personal but fixed;
BatchNorm running statistics personal. The head is the model factory's random initialization
from the run's seed (`TorchDevice.base_model`), so every device holds the same head; it never
travels and is never trained during federated training (the paper: "the head is randomly
initialized and never updated").

Local objective: cross-entropy of the whole network, minimized over the body alone
(`PartSharingDevice.train_parts`: the head has no gradient and is in no optimizer, so it stays
bit-identical), for the run's `local_epochs`.

Up: the body's parameters after local training; down: their example-weighted mean (FedAvg of the
body). Evaluation: the device loads the global body and scores it with the fixed head
(`global_accuracy`: body and head are the same on every device, so this is the global model);
then it fine-tunes a copy of the whole model, body and head, with cross-entropy on its training
split for `finetune_epochs`, and the personalized `accuracy` is the fine-tuned copy's. The copy is
thrown away, so the next round trains from the global body and the fixed head again. Deployed
model: the fine-tuned copy.

Defaults: `finetune_epochs = 5`, the paper's tau_f for its personalized accuracy; the run's
`local_epochs` for the body. Decisions: the fine-tuning covers the whole model, body and head, as
the paper's personalization does (head-only fine-tuning is FedAvg+FT's). Its optimizer is the
local one, built afresh (SGD at the run's lr, momentum 0.9; the run's common optimizer under
`optimizer = "sgd"`). A device that never trained (a new client) is scored the same way: it
fine-tunes from the global body and the shared head.
"""

from __future__ import annotations

import copy

from .base import Task
from .hyper.fedbabu import Hyper as FedBABUHyper
from .part_sharing import PartSharingDevice

BODY, WHOLE = ("body",), ("body", "head")


class FedBABUDevice(PartSharingDevice):
    id = "fedbabu"
    display_name = "FedBABU"
    citation = "Oh et al. 2022"
    table_rank = 150
    Hyper = FedBABUHyper
    shared_parts = BODY

    def train_locally(self, task: Task) -> float:
        return self.train_parts(self.model, BODY, self.settings.local_epochs, self.generator(task.round))

    def evaluate(self, task: Task) -> dict[str, float]:
        self.load_shared(task)
        global_accuracy = self.test_accuracy(self.model)
        tuned = copy.deepcopy(self.model)
        self.train_parts(tuned, WHOLE, self.hyper.finetune_epochs, self.generator(task.round))
        return {"accuracy": self.test_accuracy(tuned), "global_accuracy": global_accuracy,
                "num_test": len(self.test_y)}


DEVICE = FedBABUDevice
