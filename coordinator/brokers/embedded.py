"""The zero-setup default broker: amqtt (pure Python, MQTT 3.1.1) in a child process.

Good for simulations and trying things out on one machine. Production fleets use Mosquitto or
any MQTT 3.1.1/5 broker (see docs/DEPLOYING.md); everything else here works with either.

The child is a plain `python -c` process that imports this module and amqtt only (about 0.3 s),
not a multiprocessing "spawn" child: those import the parent's `__main__` module first (a
benchmark's or a script's, with torch: seconds per broker, on the path of every run). It says
on stdout when it listens, and exits when its owner closes its stdin (as the owner's exit does,
however it ends), so no broker outlives the process that started it.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """True once a TCP connection to host:port succeeds, False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class SnapshotDict(dict):
    """A dict whose iteration walks a snapshot of its entries.

    amqtt (0.12.1) iterates its topic-filter -> subscribers dict across `await`s: when a client
    connects (sending it retained messages) and for every broadcast. A subscription that another
    client makes meanwhile raised "dictionary changed size during iteration", which dropped the
    connecting client (seen as "lost the broker connection: Unspecified error" right at
    registration, then a reconnect) or the broadcast. Iterating a snapshot removes the race; a
    subscription made during a broadcast misses only that message, as it would a moment earlier.
    """

    def __iter__(self):
        return iter(list(super().keys()))

    def items(self):
        return list(super().items())


def make_broker(config: dict):
    """An amqtt Broker for `config` with its subscription table made safe to change while it is
    iterated (see SnapshotDict). Must be called inside the event loop that will run it."""
    from amqtt.broker import Broker

    broker = Broker(config)
    if isinstance(getattr(broker, "_subscriptions", None), dict):
        broker._subscriptions = SnapshotDict(broker._subscriptions)
    return broker


def _serve(host: str, port: int, ready=None, log_level: int = logging.WARNING) -> None:
    """Run amqtt until the process is stopped. `ready`, the sending end of a Pipe, receives None
    once it listens, or why it could not start (the port taken, say), and the process ends."""
    import asyncio
    import signal

    if ready is not None:  # embedded: Ctrl-C is the owner's, which stops this process after its clients
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level)
    if log_level > logging.DEBUG:
        # amqtt logs every abrupt disconnect, and tracebacks of its own races on teardown, loudly
        for name in ("amqtt", "asyncio", "transitions"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}", "max_connections": 0}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }

    async def main() -> None:
        broker = make_broker(config)
        try:
            await broker.start()
        except Exception as exc:  # amqtt's BrokerError wraps the bind's OSError
            if ready is None:
                raise
            ready.send(str(exc))
            return
        if ready is not None:
            ready.send(None)
        await asyncio.Event().wait()

    asyncio.run(main())


_CHILD = "from coordinator.brokers.embedded import serve_child; serve_child()"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The folder that holds the `coordinator` package, put first on the child's PYTHONPATH."""


class _StdoutReady:
    """The child's end of the start handshake: one line on stdout (`ready`, or `error <why>`),
    then stdout is pointed at /dev/null so that nothing amqtt prints can fill the unread pipe."""

    def send(self, error: str | None) -> None:
        sys.stdout.write("ready\n" if error is None else f"error {error}\n")
        sys.stdout.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _exit_when_stdin_closes() -> None:
    sys.stdin.buffer.read()  # returns at EOF: the owner closed the pipe, or exited
    os._exit(0)


def serve_child() -> None:
    """The broker process that `EmbeddedBroker` starts: `sys.argv[1:]` are host, port and log level."""
    host, port, log_level = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    threading.Thread(target=_exit_when_stdin_closes, daemon=True, name="owner-watch").start()
    _serve(host, port, _StdoutReady(), log_level)


class EmbeddedBroker:
    """Context manager: an amqtt broker on a free loopback port; `url` says where.

    A free port is free when it is picked, not always when the broker binds it: on a busy machine
    an outgoing connection can take it as its local port in between. A broker on a port it picked
    itself then tries another (START_ATTEMPTS in all); one on a port it was given fails at once.
    """

    START_ATTEMPTS = 3

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, start_timeout: float = 30.0):
        self.host = host
        self.port = port or free_port(host)
        self.port_given = port is not None
        self.start_timeout = start_timeout
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self) -> EmbeddedBroker:
        try:
            import amqtt  # noqa: F401
        except ImportError:
            raise RuntimeError("the embedded broker needs amqtt: pip install 'edgepfl[broker]', "
                               "or pass --broker mqtt://host:port for an existing broker") from None
        error = self._start_process()
        for _ in range(0 if self.port_given else self.START_ATTEMPTS - 1):
            if error is None:
                break
            log.info("embedded amqtt broker: could not start on port %d (%s); trying another port", self.port, error)
            self.port = free_port(self.host)
            error = self._start_process()
        if error is not None:
            raise RuntimeError(f"the embedded amqtt broker did not start on {self.url}: {error}")
        log.info("embedded amqtt broker on %s", self.url)
        return self

    def _start_process(self) -> str | None:
        """Start the broker process on self.port; None once it listens, else why not (it is then stopped)."""
        paths = [str(_PACKAGE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        process = self._process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, self.host, str(self.port), str(logging.getLogger().getEffectiveLevel())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
        assert process.stdout is not None
        answered, _, _ = select.select([process.stdout], [], [], self.start_timeout)
        line = process.stdout.readline().decode(errors="replace").strip() if answered else None
        process.stdout.close()
        if line == "ready":
            error = None
        elif line is None:
            error = f"it did not listen within {self.start_timeout:g} s"
        elif line.startswith("error "):
            error = line[len("error "):]
        else:
            error = f"it exited (code {process.wait()})"
        if error is not None:
            self.stop()
        return error

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            if self._process.stdin is not None:
                self._process.stdin.close()
            self._process = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
