"""FedAvg with local fine-tuning (FedAvg+FT), the standard personalization baseline of e.g.
Collins et al. 2021 (FedRep, Sec. 5) and the PFL benchmarks: train exactly as FedAvg (McMahan et
al., 2017), then personalize the global model by fine-tuning its classifier locally.

Partition, up and down: as FedAvg. Up: all parameters after local training (BatchNorm running
statistics stay on the device); down: their example-weighted mean.

Evaluation: the device loads the global model and scores it (`global_accuracy`), then fine-tunes
`head` with cross-entropy for `ft_epochs` on a copy of the model, body frozen, with the run's
optimizer settings; the personalized `accuracy` is the fine-tuned copy's. The head learns on the
frozen body's features as the copy will compute them (BatchNorm statistics recomputed on the
device's data, evaluation mode), extracted once (`PartSharingDevice.train_head_on_features`).
The copy is thrown away, so the next round trains from the global model as in FedAvg.
"""

from __future__ import annotations

import copy

from .base import Task
from .hyper.fedavg_ft import Hyper as FedAvgFTHyper
from .part_sharing import PartSharingDevice


class FedAvgFTDevice(PartSharingDevice):
    id = "fedavg_ft"
    display_name = "FedAvg+FT"
    citation = None
    table_rank = 30
    Hyper = FedAvgFTHyper
    shared_parts = ("body", "head")

    def evaluate(self, task: Task) -> dict[str, float]:
        self.load_shared(task)
        global_accuracy = self.test_accuracy(self.model)
        tuned = copy.deepcopy(self.model)
        self.train_head_on_features(tuned, self.hyper.ft_epochs, self.generator(task.round))
        return {"accuracy": self.test_accuracy(tuned), "global_accuracy": global_accuracy,
                "num_test": len(self.test_y)}


DEVICE = FedAvgFTDevice
