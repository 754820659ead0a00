"""The simulation's worker watch: a worker process that dies mid-run is named, with its devices."""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time

from coordinator.simulate import watch_workers


def start_sleeper(context) -> multiprocessing.Process:
    process = context.Process(target=time.sleep, args=(600,), name="worker1", daemon=True)
    process.start()
    return process


def test_a_killed_worker_is_logged_with_its_devices_and_the_oom_hint(caplog) -> None:
    # Prepare
    process = start_sleeper(multiprocessing.get_context("spawn"))

    # Execute: SIGKILL from outside, as the kernel's OOM killer does
    with caplog.at_level(logging.ERROR, logger="coordinator.simulate"):
        watcher = watch_workers({process: ["dev001", "dev003"]}, threading.Event())
        process.kill()
        watcher.join(timeout=60)

    # Assert
    assert not watcher.is_alive()
    assert "worker1 died with signal SIGKILL" in caplog.text
    assert "OOM killer" in caplog.text and "dev001, dev003" in caplog.text


def test_workers_stopped_after_the_run_are_not_reported(caplog) -> None:
    # Prepare
    process = start_sleeper(multiprocessing.get_context("spawn"))
    done = threading.Event()

    # Execute: the run is over, then the worker is terminated
    with caplog.at_level(logging.ERROR, logger="coordinator.simulate"):
        watcher = watch_workers({process: ["dev000"]}, done)
        done.set()
        process.terminate()
        watcher.join(timeout=60)

    # Assert
    assert not watcher.is_alive()
    assert process.exitcode != 0 and caplog.text == ""


class ReapedElsewhere:
    """A worker the run's own join reaped first: its sentinel is ready and its exit code unknown here."""

    name = "worker0"
    exitcode = None

    def __init__(self) -> None:
        read_end, write_end = multiprocessing.Pipe(duplex=False)
        write_end.close()
        self._read_end = read_end  # kept open: the sentinel is its file descriptor
        self.sentinel = read_end.fileno()

    def join(self) -> None:
        pass


def test_a_worker_reaped_by_the_run_is_neither_reported_nor_fatal_to_the_watch(caplog, monkeypatch) -> None:
    # Prepare
    crashes = []
    monkeypatch.setattr(threading, "excepthook", crashes.append)

    # Execute
    with caplog.at_level(logging.ERROR, logger="coordinator.simulate"):
        watcher = watch_workers({ReapedElsewhere(): ["dev000"]}, threading.Event())
        watcher.join(timeout=60)

    # Assert
    assert not watcher.is_alive()
    assert crashes == [] and caplog.text == ""
