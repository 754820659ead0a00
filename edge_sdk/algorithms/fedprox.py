"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

Local objective (Eq. 2 of the paper): h_k(w; w^t) = F_k(w) + mu/2 * ||w - w^t||^2, with F_k the
cross-entropy on client k's data and w^t the global model received this round. The proximal
term runs over the shared parameters (every parameter; BatchNorm running statistics are buffers
and personal), so its gradient is exactly mu * (w - w^t).

Partition, up and down: as FedAvg. Up: all parameters after local training; down: their
example-weighted mean. The device deploys the global model (`global_accuracy` is reported).
"""

from __future__ import annotations


import torch

from ..privacy.dpsgd import PenalizedLoss
from ..training import LossFn
from .base import Task
from .hyper.fedprox import Hyper as FedProxHyper
from .part_sharing import PartSharingDevice


class FedProxDevice(PartSharingDevice):
    id = "fedprox"
    display_name = "FedProx"
    citation = "Li et al. 2020"
    table_rank = 40
    Hyper = FedProxHyper
    shared_parts = ("body", "head")
    deploys_global_model = True

    def shared_parameters(self) -> list[torch.nn.Parameter]:
        shared = set(self.partition.shared)
        return [p for name, p in self.model.named_parameters() if name in shared]

    def local_loss(self, task: Task) -> LossFn:
        """CE (or the trainer's own loss) + mu/2 * ||w - w_global||^2, anchored at the shared
        parameters as they are now (`fit` calls this right after loading the global model). The
        proximal term sees no record, only the parameters and the broadcast model: under DP-SGD
        its gradient is added after the noise, unclipped (`PenalizedLoss`)."""
        params = self.shared_parameters()
        anchor = [p.detach().clone() for p in params]
        mu = self.hyper.mu

        def proximal() -> torch.Tensor:
            return 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))

        return PenalizedLoss(self.objective(self.model), proximal)


DEVICE = FedProxDevice
