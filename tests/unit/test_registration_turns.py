"""Simulated devices register in index order whatever order their threads start in."""

from __future__ import annotations

import multiprocessing
import threading

from coordinator.simulate import RegistrationTurns


def test_devices_register_in_index_order_whatever_order_they_start_in() -> None:
    # Prepare: three devices whose threads start in reverse order
    turns = RegistrationTurns(multiprocessing.get_context("spawn"), 3)
    registered: list[int] = []

    def register(index: int) -> None:
        turns.wait_for(index)
        registered.append(index)
        turns.done(index)

    threads = [threading.Thread(target=register, args=(index,)) for index in (2, 1, 0)]

    # Execute
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    # Assert
    assert registered == [0, 1, 2]


def test_a_device_that_never_registers_holds_back_nobody_once_its_worker_gives_up() -> None:
    # Prepare: device 0's worker failed and released its devices 0 and 2
    turns = RegistrationTurns(multiprocessing.get_context("spawn"), 4)
    turns.done(0, 2)
    registered: list[int] = []

    def register(index: int) -> None:
        turns.wait_for(index)
        registered.append(index)
        turns.done(index)

    threads = [threading.Thread(target=register, args=(index,)) for index in (3, 1)]

    # Execute
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    # Assert
    assert registered == [1, 3]
