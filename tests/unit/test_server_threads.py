"""The coordinator's round step runs on one thread, so its float reductions repeat on any machine."""

from __future__ import annotations

import torch
from threadpoolctl import threadpool_info, threadpool_limits

from builtin_tasks import DIGITS
from coordinator.algorithms import load as load_server
from coordinator.algorithms.base import ServerContext
from edge_sdk.algorithms.base import NoHyper


def test_close_round_runs_end_round_on_one_thread_and_restores_the_threads(monkeypatch):
    # Prepare: a server whose end_round records the threads it computes on
    seen: dict[str, object] = {}

    def end_round(round_: int) -> None:
        seen["torch"] = torch.get_num_threads()
        seen["blas"] = {pool["num_threads"] for pool in threadpool_info()}

    server = load_server("fedavg")(NoHyper(), ServerContext("cnn8", DIGITS, seed=0, rounds=1, clients=2))
    monkeypatch.setattr(server, "end_round", end_round)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with threadpool_limits(2):
            # Execute
            server.close_round(1)

            # Assert
            assert seen == {"torch": 1, "blas": {1}}
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
