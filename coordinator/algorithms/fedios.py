"""FediOS (Gao, Li, Lu and Wu), server side: FedAvg of `body` and `head`, and the projection blocks.

Paper: Eq. (6) and Alg. 1 (docs/ALGORITHMS.md, "FediOS"). The server averages the generic extractor `body`
and the classifier `head` (on R^D, D = (B + 1) d) weighted by n_k; it never sees a
`personal_body`.

Blocks: each device gets, at its first registration, the smallest free personal block
b in 1..B (block 0 is the generic subspace P^g); registering again returns the same block, and a
late joiner gets the next free one. The assignment is `{"block": b, "capacity": B}`. The map
lives in the checkpointed state as group `blocks` (array name = client id, value = a 0-d int64
array), so it survives a coordinator restart; it is never broadcast. A device that registered
after the last checkpoint and before a crash is not in the restored map; because blocks are
handed out smallest-free-first, it normally gets the same block again. When all B blocks are
taken, further devices share blocks cyclically (such devices share one personal subspace, still
orthogonal to P^g) and a warning names the fix: a larger `capacity`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from torch import nn

from edge_sdk.algorithms.fedios import FediOSDevice, seeded_body, shared_head
from edge_sdk.algorithms.torch_device import SHARED, model_partition
from edge_sdk.protocol import ArrayGroup
from edge_sdk.training import state_arrays

from .part_sharing import PartSharingServer

log = logging.getLogger(__name__)

BLOCKS = "blocks"
"""State group of the block map: client id -> 0-d int64 array."""


class FediOSServer(PartSharingServer):
    id = "fedios"
    Hyper = FediOSDevice.Hyper
    device = FediOSDevice

    @property
    def capacity(self) -> int:
        """B, the number of personal blocks."""
        return self.hyper.capacity or self.context.clients

    def initial_state(self) -> dict[str, ArrayGroup]:
        task, seed = self.context.task, self.context.seed
        body, feature_dim = seeded_body(self.context.model, task, seed)
        parts = nn.ModuleDict({"body": body, "head": shared_head(feature_dim, self.capacity, task.num_classes, seed)})
        return {SHARED: state_arrays(parts, model_partition(parts, self.device.shared_parts).shared), BLOCKS: {}}

    def task_groups(self, round_: int) -> dict[str, ArrayGroup]:
        return {SHARED: self.state[SHARED]}

    def eval_groups(self) -> dict[str, ArrayGroup]:
        return {SHARED: self.state[SHARED]}

    def assignment(self, client_id: str) -> dict[str, Any]:
        blocks = self.state[BLOCKS]
        if client_id not in blocks:
            blocks[client_id] = np.array(self._free_block(), dtype=np.int64)
            log.info("%s gets personal block %d of %d", client_id, int(blocks[client_id]), self.capacity)
        return {"block": int(blocks[client_id]), "capacity": self.capacity}

    def _free_block(self) -> int:
        taken = {int(b) for b in self.state[BLOCKS].values()}
        free = [b for b in range(1, self.capacity + 1) if b not in taken]
        if free:
            return free[0]
        block = 1 + len(self.state[BLOCKS]) % self.capacity
        log.warning("all %d personal blocks are taken; sharing block %d (set a larger `capacity`)",
                    self.capacity, block)
        return block

    def end_round(self, round_: int) -> None:
        self.state = {**self.state, SHARED: self._mean.result()}


SERVER = FediOSServer
