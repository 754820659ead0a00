"""Watching a run's child processes: device workers and shard aggregators.

A `WorkerWatch` thread logs, naming what the run lost, any child that dies mid-run (its error
from the child's pipe, or the signal or exit code that ended it; a child ended with the whole
process group is no death once the parent is stopping too), and says when every one is gone;
the coordinator's channel then raises the workers' failure (`WatchedChannel`, `WorkersFailed`)
instead of waiting for registrations that cannot come. `stop_processes` ends those still alive.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import signal
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge_sdk.channel import Channel, Received

log = logging.getLogger(__name__)

LOGGED_ERROR = 160
"""A dead worker's error is logged up to this many characters (the run's failure has it all)."""


DEVICES_GONE = "its devices are gone"
SHARD_LOST = "its shard's updates are lost from now on (each round's lost_shards says so)"
"""What the run loses when a device worker, an aggregator process dies (`WorkerWatch`)."""


STOP_SIGNALS = frozenset(-sig for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT))
"""Exit codes of a child ended by a signal that stops a whole process group (`systemctl stop`,
`kill -TERM -PGID`, a closed terminal): this process is being stopped too, unwinds and sets `done`."""
STOPPING_GRACE = 5.0
"""Seconds a `WorkerWatch` waits for `done` before it reports a child ended by one of `STOP_SIGNALS`."""


class WorkersFailed(RuntimeError):
    """Every device worker process is gone before the run finished: no device is left."""


class WorkerWatch(threading.Thread):
    """Watches the device worker (or aggregator) processes until `done` is set: logs an error
    naming what the run lost (`loss`, then what `workers` maps each process to: its device ids,
    its shard) and the error (from `errors`, the read end of each process's pipe, when given) of
    any process that dies mid-run, and sets `all_dead` once every one is gone.

    Its devices' Last Wills make the coordinator close the round without them; without this line
    the run would only say that nobody replied. A worker killed by SIGKILL was most often the
    kernel's OOM killer (see `dmesg`).
    """

    def __init__(self, workers: dict[BaseProcess, list[str]], done: threading.Event,
                 errors: dict[BaseProcess, Connection] | None = None,
                 loss: str = DEVICES_GONE):
        super().__init__(name="worker-watch", daemon=True)
        self.workers, self.done, self.errors, self.loss = workers, done, errors or {}, loss
        self.all_dead = threading.Event()
        self.causes: dict[str, list[str]] = {}  # a dead worker's cause -> the workers it ended
        self._lock = threading.Lock()

    def run(self) -> None:
        alive = list(self.workers)
        while alive and not self.done.is_set():
            ended = multiprocessing.connection.wait([p.sentinel for p in alive])
            for process in [p for p in alive if p.sentinel in ended]:
                alive.remove(process)
                process.join()
                code = process.exitcode  # None when the run's own join reaped it first (after `done`)
                if code in STOP_SIGNALS and self.done.wait(STOPPING_GRACE):
                    continue  # stopped with this process (a signal to the process group): no death to report
                if not self.done.is_set() and code not in (0, None):
                    self._report(process, code)
        if not alive and not self.done.is_set():
            self.all_dead.set()

    def _report(self, process: BaseProcess, code: int) -> None:
        error = self._error_of(process)
        if error is not None:
            cause, shown = error, f"error: {error if len(error) <= LOGGED_ERROR else error[:LOGGED_ERROR] + '...'}"
        else:
            cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            oom = " (SIGKILL: most often the OOM killer; see dmesg)" if code == -signal.SIGKILL else ""
            shown = cause + oom
        log.error("%s died with %s; %s: %s", process.name, shown, self.loss, ", ".join(self.workers[process]))
        with self._lock:
            self.causes.setdefault(cause, []).append(process.name)

    def _error_of(self, process: BaseProcess) -> str | None:
        pipe = self.errors.get(process)
        return None if pipe is None else pending_error(pipe)

    def failure(self) -> WorkersFailed:
        """The error of a run whose workers are all gone: their causes, each with its workers."""
        with self._lock:
            causes = "; ".join(f"{cause} ({', '.join(names)})" for cause, names in self.causes.items())
        return WorkersFailed(f"every device worker died before the run finished: {causes or 'no error reported'}")


def pending_error(pipe: Connection) -> str | None:
    """The error a worker left in its pipe, if any."""
    try:
        return pipe.recv_bytes().decode(errors="replace") if pipe.poll() else None
    except (EOFError, OSError):
        return None


def watch_workers(workers: dict[BaseProcess, list[str]], done: threading.Event,
                  errors: dict[BaseProcess, Connection] | None = None,
                  loss: str = DEVICES_GONE) -> WorkerWatch:
    """Start a `WorkerWatch` over `workers` (see there)."""
    watch = WorkerWatch(workers, done, errors, loss)
    watch.start()
    return watch


class WatchedChannel:
    """The coordinator's channel, raising the workers' failure from `receive` once every worker
    is gone (`WorkerWatch.all_dead`): then no device can register or reply any more. Everything
    else is the channel's."""

    POLL = 0.5
    """Longest wait between two looks at the workers."""

    def __init__(self, channel: Channel, watch: WorkerWatch):
        self._channel, self._watch = channel, watch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)

    def receive(self, timeout: float) -> Received | None:
        deadline = time.monotonic() + timeout
        while True:
            if self._watch.all_dead.is_set():
                raise self._watch.failure()
            received = self._channel.receive(max(0.0, min(self.POLL, deadline - time.monotonic())))
            if received is not None or time.monotonic() >= deadline:
                return received


def stop_processes(processes: Sequence[BaseProcess], pipes: Sequence[Connection]) -> None:
    """Terminate those of `processes` still alive (and wait for them), then close `pipes`."""
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=10)
        if process.is_alive():  # stuck: nothing is left behind
            process.kill()
            process.join(timeout=10)
    for pipe in pipes:
        pipe.close()
