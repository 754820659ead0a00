"""The simulation's worker watch: a worker process that dies mid-run is named, with its devices and
its error; once every worker is gone, the coordinator's channel stops the run with their errors."""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import cast

import pytest

from coordinator.hosting import worker_watch
from coordinator.hosting.worker_watch import WatchedChannel, WorkerWatch, WorkersFailed, watch_workers
from edge_sdk.channel import Channel


def start_sleeper(context) -> multiprocessing.Process:
    process = context.Process(target=time.sleep, args=(600,), name="worker1", daemon=True)
    process.start()
    return process


def test_a_killed_worker_is_logged_with_its_devices_and_the_oom_hint(caplog) -> None:
    # Prepare
    process = start_sleeper(multiprocessing.get_context("spawn"))

    # Execute: SIGKILL from outside, as the kernel's OOM killer does
    with caplog.at_level(logging.ERROR, logger="coordinator.hosting.worker_watch"):
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
    with caplog.at_level(logging.ERROR, logger="coordinator.hosting.worker_watch"):
        watcher = watch_workers({process: ["dev000"]}, done)
        done.set()
        process.terminate()
        watcher.join(timeout=60)

    # Assert
    assert not watcher.is_alive()
    assert process.exitcode != 0 and caplog.text == ""


class Stopping(threading.Event):
    """The run's `done`, telling when the watch waits on it (the grace for a signalled worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.awaited = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.awaited.set()
        return super().wait(timeout)


def test_a_worker_ended_by_sigterm_as_the_run_stops_is_not_reported(caplog) -> None:
    # Prepare
    process = start_sleeper(multiprocessing.get_context("spawn"))
    done = Stopping()

    # Execute: SIGTERM to the whole process group ends the worker; the run then stops too
    with caplog.at_level(logging.ERROR, logger="coordinator.hosting.worker_watch"):
        watcher = watch_workers({process: ["dev000"]}, done)
        process.terminate()
        assert done.awaited.wait(60), "the watch did not wait for the run to stop"
        done.set()
        watcher.join(timeout=60)

    # Assert
    assert not watcher.is_alive()
    assert process.exitcode == -signal.SIGTERM and caplog.text == ""


def test_a_worker_ended_by_sigterm_while_the_run_goes_on_is_reported(caplog, monkeypatch) -> None:
    # Prepare
    monkeypatch.setattr(worker_watch, "STOPPING_GRACE", 0.1)
    process = start_sleeper(multiprocessing.get_context("spawn"))

    # Execute
    with caplog.at_level(logging.ERROR, logger="coordinator.hosting.worker_watch"):
        watcher = watch_workers({process: ["dev000"]}, threading.Event())
        process.terminate()
        watcher.join(timeout=60)

    # Assert
    assert not watcher.is_alive()
    assert "worker1 died with signal SIGTERM" in caplog.text and watcher.all_dead.is_set()


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
    crashes: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", crashes.append)

    # Execute
    with caplog.at_level(logging.ERROR, logger="coordinator.hosting.worker_watch"):
        watcher = watch_workers({cast(BaseProcess, ReapedElsewhere()): ["dev000"]}, threading.Event())
        watcher.join(timeout=60)

    # Assert
    assert not watcher.is_alive()
    assert crashes == [] and caplog.text == ""


def failing_worker(context, name: str, error: str) -> tuple[multiprocessing.Process, Connection]:
    """A worker that has sent `error` through its pipe and exits with code 1, as `_worker_main` does."""
    read_end, write_end = context.Pipe(duplex=False)
    write_end.send_bytes(error.encode())
    process = context.Process(target=sys.exit, args=(1,), name=name, daemon=True)
    process.start()
    return process, read_end


def test_when_every_worker_died_the_failure_names_their_error_once(caplog):
    # Prepare
    context = multiprocessing.get_context("spawn")
    first, first_errors = failing_worker(context, "worker0", "mnist not found: pass --data-dir")
    second, second_errors = failing_worker(context, "worker1", "mnist not found: pass --data-dir")

    # Execute
    with caplog.at_level(logging.ERROR, logger="coordinator.hosting.worker_watch"):
        watch = watch_workers({first: ["dev000"], second: ["dev001"]}, threading.Event(),
                              {first: first_errors, second: second_errors})
        watch.join(timeout=60)

    # Assert
    assert watch.all_dead.is_set()
    message = str(watch.failure())
    assert message.count("mnist not found: pass --data-dir") == 1
    assert "worker0" in message and "worker1" in message
    assert "worker0 died with error: mnist not found" in caplog.text


class SilentChannel:
    """A channel on which nothing arrives."""

    topics = "the channel's topics"

    def receive(self, timeout: float):
        return None


def test_the_watched_channel_raises_the_workers_failure_once_all_are_dead():
    # Prepare
    watch = WorkerWatch({}, threading.Event())
    watch.causes["ValueError: classes_per_client must be in [1, 10]"] = ["worker0"]
    channel = WatchedChannel(cast(Channel, SilentChannel()), watch)
    before = channel.receive(0.2)

    # Execute
    watch.all_dead.set()
    with pytest.raises(WorkersFailed, match=r"every device worker died.*classes_per_client.*\(worker0\)"):
        channel.receive(60)

    # Assert: until then it waited as the channel does, and it is the channel otherwise
    assert before is None and channel.topics == "the channel's topics"
