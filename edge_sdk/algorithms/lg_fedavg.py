"""LG-FedAvg (Liang et al., "Think Locally, Act Globally: Federated Learning with Local and
Global Representations", 2020).

Partition: the top layers are global, the lower layers local (Algorithm 1 of the paper): here
`head` is shared and `body` (with its BatchNorm statistics) is personal. Local objective:
cross-entropy, body and head trained jointly.

Up: the head's parameters after local training; down: their example-weighted mean (FedAvg of
the global layers). Deployed model: the client's own body with the global head (no complete
global model exists, so no `global_accuracy`).
"""

from __future__ import annotations

from .part_sharing import PartSharingDevice


class LGFedAvgDevice(PartSharingDevice):
    id = "lg_fedavg"
    display_name = "LG-FedAvg"
    citation = "Liang et al. 2020"
    table_rank = 70
    shared_parts = ("head",)


DEVICE = LGFedAvgDevice
