"""FedPer (Arivazhagan et al., "Federated Learning with Personalization Layers", 2019).

Partition: `body` (base layers) shared, `head` (personalization layer) personal; BatchNorm
running statistics personal. Local objective: cross-entropy, body and head trained jointly
(Sec. 3 of the paper: the base layers are federated with FedAvg, the personalization layers
are only ever trained locally).

Up: the body's parameters after local training; down: their example-weighted mean (FedAvg).
Deployed model: the global body with the client's own head (no global model exists, so no
`global_accuracy`). A device that has not trained yet fits its head on the frozen global body
(10 epochs) before it is scored (`PersonalHeadDevice`).
"""

from __future__ import annotations

from .part_sharing import PersonalHeadDevice


class FedPerDevice(PersonalHeadDevice):
    id = "fedper"
    display_name = "FedPer"
    citation = "Arivazhagan et al. 2019"
    table_rank = 50


DEVICE = FedPerDevice
