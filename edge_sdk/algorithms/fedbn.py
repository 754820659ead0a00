"""FedBN (Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021).

Partition: every BatchNorm layer is personal, its affine parameters (weight gamma, bias beta) and
its running statistics alike (`share_batchnorm` off; the layers are found by module type, not
by name); every other parameter of `body` and `head` is shared. Local objective:
cross-entropy, the whole model (the device's own BatchNorm layers included) trained jointly with
SGD, as FedAvg (Algorithm 1 of the paper: local updates of all layers, then aggregation of the
non-BN layers only).

Up: the non-BatchNorm parameters after local training; down: their example-weighted mean,
w = sum_k (n_k / n) w_k over the non-BN layers. The device loads the mean into its non-BN layers
and keeps its own BatchNorm layers: they are never uploaded and never overwritten. Deployed
model: the global non-BN layers with the device's own BatchNorm layers (no global model exists,
so no `global_accuracy`).

Defaults: no hyperparameters of its own (the paper's knobs are FedAvg's: local epochs, lr and
batch size, the run's). Decisions: Algorithm 1 of the paper averages the non-BN layers uniformly
(1/K), its experiments giving every client the same number of examples; here the weights are
FedAvg's n_k / n, which is the paper's mean whenever the clients hold equal amounts and FedAvg's
otherwise. The paper evaluates only clients that train (every client, every round); a device that
never trained (a new client) is scored with the BatchNorm layers it was initialized with. There
is no global body to release: a release refuses, its BatchNorm parameters being personal.
"""

from __future__ import annotations

from .part_sharing import PartSharingDevice


class FedBNDevice(PartSharingDevice):
    id = "fedbn"
    display_name = "FedBN"
    citation = "Li et al. 2021"
    table_rank = 140
    shared_parts = ("body", "head")
    share_batchnorm = False


DEVICE = FedBNDevice
