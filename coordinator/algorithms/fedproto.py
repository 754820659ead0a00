"""FedProto (Tan et al., AAAI 2022), server side: global class prototypes, Eq. (6).

The server holds only the global prototypes (`global_prototypes`: `prototypes` [C, d],
`has_prototype` [C]); it never holds a model. Each device uploads its terms of Eq. (6) divided
by its N_i examples (`prototypes`: `class_shares` |D_i,j| / N_i, `feature_sums`
|D_i,j| / N_i * C_i^(j), see `edge_sdk.algorithms.fedproto`), and the round sums them weighted
by the update's weight w_i, in float64. With w_i = N_i (the coordinator's example weights) the
global prototype of class j is

    C_bar^(j) = sum_i w_i feature_sums_i[j] / sum_i w_i class_shares_i[j]
              = sum_i |D_i,j| C_i^(j) / sum_i |D_i,j|,

the count-weighted mean over the devices that have class j (Eq. 6). A weight capped by the run's
`max_examples` weighs that device's prototypes less, and under secure aggregation a device's
terms clipped to `secagg_clip` shrink together, so each stays a weighted mean of prototypes.
Both sums are sums of per-update terms: shard aggregators send them as partial sums, and secure
aggregation's masked sum is exactly them (the uploads are float and share no name with what came
down, so the devices' vectors are w_i x their terms).

Decision: the count weights. Eq. (6) as printed, (1 / |N_j|) sum_{i in N_j} |D_i,j| / N_j C_i^(j),
carries an extra 1 / |N_j| that would shrink a prototype with the number of devices having the
class (read as a typo); the official code and PFLlib average the devices' prototypes unweighted.
We keep the paper's weights |D_i,j| / N_j without the extra factor: the mean of every feature of
class j over the round's devices.

Decision: the global prototypes of a round are those of that round's reports only, as the paper's
Algorithm 1 and its code replace them each round: a class that no reporting device has has no
prototype next round. A round without reports keeps the previous ones. The run's aggregation
rule and `clip_norm` do not apply: Eq. (6) is the pooling, as DC-PFL's statistics are pooled.

Heterogeneous models: `Hyper.body_models`, handed out as DC-PFL's bodies (round-robin in
registration order); each must have FedProto's capabilities and the run's model's feature dimension.
"""

from __future__ import annotations

import logging

import numpy as np

from edge_sdk.algorithms.fedproto import (
    GLOBAL_PROTOTYPES,
    PROTOTYPES,
    FedProtoDevice,
    prototypes_spec,
)
from edge_sdk.algorithms.hyper.fedproto import Hyper as FedProtoHyper
from edge_sdk.params import ArraySpec
from edge_sdk.protocol import ArrayGroup, Reason, ValidationError

from ..aggregation.averaging import PartialSum, WeightedMean
from ..privacy.policy import CLASS_STATISTICS
from .base import ServerAlgorithm, ServerContext
from .body_models import BodyModels

log = logging.getLogger(__name__)

SHARE_TOLERANCE = 1e-3
"""How far above 1 a device's class shares may sum (float32, or a lossy upload codec, rounding)."""


class FedProtoServer(ServerAlgorithm):
    """Holds the global prototypes; pools the devices' prototypes by class counts (Eq. 6)."""

    id = "fedproto"
    Hyper = FedProtoHyper
    unshardable = None
    asynchronous = "its global prototypes pool class prototypes by class counts, not changes to what it sent"

    def __init__(self, hyper: FedProtoHyper, context: ServerContext):
        self.num_classes = context.task.num_classes
        self.bodies = BodyModels(hyper.body_model_names(), FedProtoDevice, context)
        self.dim = self.bodies.dim
        self._sums = WeightedMean(dtype="float64")
        super().__init__(hyper, context)

    # -- state and what travels --------------------------------------------------------------
    def initial_state(self) -> dict[str, ArrayGroup]:
        return {GLOBAL_PROTOTYPES: {"prototypes": np.zeros((self.num_classes, self.dim), np.float32),
                                    "has_prototype": np.zeros(self.num_classes, bool)}}

    def assignment(self, client_id: str) -> dict[str, str]:
        return self.bodies.assignment(client_id)

    def update_spec(self, round_: int) -> dict[str, ArraySpec]:
        return {PROTOTYPES: prototypes_spec(self.num_classes, self.dim)}

    def upload_kinds(self) -> dict[str, str]:
        return {PROTOTYPES: CLASS_STATISTICS}

    def validate_update(self, client_id: str, groups: dict[str, ArrayGroup], metrics: dict[str, float],
                        registered_examples: int) -> None:
        upload = groups[PROTOTYPES]
        for name, array in upload.items():
            if not np.isfinite(array).all():
                raise ValidationError(Reason.NON_FINITE, f"{client_id}: {PROTOTYPES}/{name} has non-finite values")
        shares = np.asarray(upload["class_shares"], dtype=np.float64)
        if (shares < 0).any() or shares.sum() > 1 + SHARE_TOLERANCE:
            raise ValidationError(Reason.MALFORMED, f"{client_id}: class shares {shares.tolist()} are not the "
                                                    "shares of its examples by class")

    # -- aggregation ---------------------------------------------------------------------------
    def begin_round(self, round_: int) -> None:
        self._sums = WeightedMean(dtype="float64")

    def accumulate(self, client_id: str, groups: dict[str, ArrayGroup], metrics: dict[str, float],
                   weight: float) -> None:
        self._sums.add(groups[PROTOTYPES], weight)

    def end_round(self, round_: int) -> None:
        if self._sums.count == 0:
            log.warning("fedproto round %d: no prototypes; global prototypes unchanged", round_)
            return
        sums = self._sums.partial().sums  # the ratio of two sums: the common denominator cancels
        shares, features = sums["class_shares"], sums["feature_sums"]
        has_prototype = shares > 0
        prototypes = np.divide(features, shares[:, None], out=np.zeros_like(features),
                               where=has_prototype[:, None])
        self.state = {GLOBAL_PROTOTYPES: {"prototypes": prototypes.astype(np.float32),
                                          "has_prototype": has_prototype}}
        log.info("fedproto round %d: %d reports, %d classes with a global prototype",
                 round_, self._sums.count, int(has_prototype.sum()))

    # -- sharded aggregation and secure aggregation -------------------------------------------
    def begin_partial(self, round_: int, sent: dict[str, ArrayGroup]) -> None:
        self.state = sent
        self.begin_round(round_)

    def partial(self) -> dict[str, PartialSum]:
        return {PROTOTYPES: self._sums.partial()}

    def partial_spec(self, round_: int) -> dict[str, ArraySpec]:
        return {PROTOTYPES: {key: (shape, "float64") for key, (shape, _) in
                             prototypes_spec(self.num_classes, self.dim).items()}}

    def fold_partial(self, round_: int, partial: dict[str, PartialSum]) -> None:
        dtypes = {key: np.dtype(dtype) for key, (_, dtype) in prototypes_spec(self.num_classes, self.dim).items()}
        self._sums.add_partial(partial[PROTOTYPES], dtypes)


SERVER = FedProtoServer
