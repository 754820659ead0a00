"""Mosquitto for tests and benchmarks: on a free port with its own config, or with a given config.

In a test, a missing Mosquitto skips it, and under CI (CI=true) fails it: the integration tests
must run. A benchmark passes the binary it found (`mosquitto_binary`) and says what to do instead.
The pytest fixtures over these (and amqtt's) are in tests/conftest.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from coordinator.brokers.embedded import free_port, wait_for_port

from .hosts import stop_process


def mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")


def require_binary(name: str, binary: str | None) -> str:
    """`binary`, the path of Debian package `name`'s program; when it is missing (None) the test
    fails in CI (CI=true: `make test` installs it there) and skips elsewhere, saying why."""
    if binary is None:
        message = f"{name} is not installed (apt-get install {name}, or run `make test` as root)"
        import pytest  # only a test gets here: a benchmark passes the binary it found

        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return binary


def require_mosquitto() -> str:
    return require_binary("mosquitto", mosquitto_binary())


class Mosquitto:
    """A Mosquitto process on a free loopback port; `extra` lines are appended to its config.

    A port picked here can be taken (by an outgoing connection's local port) before Mosquitto
    binds it; Mosquitto then exits, and a port picked here is replaced (START_ATTEMPTS in all).
    """

    START_ATTEMPTS = 3

    def __init__(self, workdir: Path, extra: str = "", port: int | None = None, binary: str | None = None):
        self.binary = binary or require_mosquitto()
        self.port = port or free_port()
        self.port_given = port is not None
        self.workdir = workdir
        self.extra = extra
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> Mosquitto:
        for attempt in range(1 if self.port_given else self.START_ATTEMPTS):
            if attempt:
                self.port = free_port()
            if self._start_process():
                return self
        raise RuntimeError(f"mosquitto did not start on port {self.port}; see {self.workdir / 'mosquitto.log'}")

    def _start_process(self) -> bool:
        """True once Mosquitto listens on self.port; False (and stopped) if it exited or timed out."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            f"log_dest file {self.workdir / 'mosquitto.log'}\n{self.extra}\n"
        )
        self.process = subprocess.Popen([self.binary, "-c", str(conf)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while self.process.poll() is None and time.monotonic() < deadline:
            if wait_for_port("127.0.0.1", self.port, 0.5):
                return True
        self.stop()
        return False

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None

    def __enter__(self) -> Mosquitto:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ConfiguredMosquitto:
    """Mosquitto started with a given configuration file, listening on `port`."""

    def __init__(self, config: Path, port: int):
        self.binary = require_mosquitto()
        self.config, self.port = config, port
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ConfiguredMosquitto:
        self.process = subprocess.Popen([self.binary, "-c", str(self.config)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        if not wait_for_port("127.0.0.1", self.port, 15):
            self.process.terminate()
            _, stderr = self.process.communicate(timeout=10)
            log = self.config.parent / "mosquitto.log"
            raise RuntimeError(f"mosquitto did not start with {self.config}: {stderr}"
                               f"{log.read_text() if log.exists() else ''}")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        self.process.communicate(timeout=10)
