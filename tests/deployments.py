"""A deployment as the README sets it up, with real processes: `edgepfl broker-config --tls`
(accounts, ACLs, mutual TLS, signing keys), its Mosquitto, and CLI processes whose output lines
tests wait on (never on the clock)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from edge_sdk.channel import Channel
from edge_sdk.protocol import Kind, Topics
from edge_sdk.transport import MqttSettings, MqttTransport

FED = "plant7"
TRAINERS = ("cam-01", "cam-02", "cam-03")
WEAK = "pi-04"
WATCHER = "watcher"  # an account that only reads the retained STATUS
WAIT = 240.0


class Process:
    """A CLI process whose output lines are read on a thread into a queue, to be waited on."""

    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.popen = subprocess.Popen([sys.executable, "-m", "coordinator.cli", *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None, "started with stdout=PIPE"
        for line in self.popen.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for_line(self, text: str, timeout: float = WAIT) -> str:
        """Block until an output line contains `text`; fail at the timeout."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                break
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} within {timeout:.0f} s:\n{''.join(self.output)[-3000:]}")

    def finish(self, timeout: float = WAIT) -> str:
        self.popen.wait(timeout=timeout)
        text = "".join(self.output)
        assert self.popen.returncode == 0, text[-3000:]
        return text

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.kill()
            self.popen.wait(timeout=30)


class Deployment:
    """The files `edgepfl broker-config --tls` wrote, and the flags each account runs with."""

    def __init__(self, root: Path, port: int, devices: tuple[str, ...] = (*TRAINERS, WEAK)):
        self.root, self.url, self.devices = root, f"mqtts://127.0.0.1:{port}", devices
        accounts = ",".join((*devices, WATCHER))
        subprocess.run([sys.executable, "-m", "coordinator.cli", "broker-config", "--out", str(root), "--federation",
                        FED, "--devices", accounts, "--port", str(port), "--tls"], check=True, capture_output=True)

    def tls(self, account: str) -> list[str]:
        return ["--ca-file", str(self.root / "tls" / "ca.crt"),
                "--cert-file", str(self.root / "tls" / "clients" / f"{account}.crt"),
                "--key-file", str(self.root / "tls" / "clients" / f"{account}.key")]

    def device(self, command: str, client_id: str, index: int, state: Path, *extra: str) -> Process:
        return Process("-v", command, "--broker", self.url, "--federation", FED, "--client-id", client_id,
                       "--dataset", "digits", "--clients", str(len(self.devices)), "--index", str(index),
                       "--partition", "dirichlet",
                       "--credentials", str(self.root / "devices" / f"{client_id}.json"), *self.tls(client_id),
                       "--state-dir", str(state / client_id), *extra)

    def watcher(self) -> MqttTransport:
        entry = json.loads((self.root / "devices" / f"{WATCHER}.json").read_text())
        entry = entry.get("devices", {}).get(WATCHER, entry)
        transport = MqttTransport(f"{FED}.{WATCHER}", MqttSettings(
            url=self.url, username=entry["username"], password=entry["password"],
            ca_file=str(self.root / "tls" / "ca.crt"), cert_file=str(self.root / "tls" / "clients" / f"{WATCHER}.crt"),
            key_file=str(self.root / "tls" / "clients" / f"{WATCHER}.key")))
        transport.connect()
        transport.subscribe(Topics(FED).broadcast(Kind.STATUS))
        return transport


def wait_for_round(channel: Channel, completed: int) -> None:
    """Block until a retained STATUS says `completed` rounds are done."""
    deadline = time.monotonic() + WAIT
    while (remaining := deadline - time.monotonic()) > 0:
        received = channel.receive(remaining)
        if received is not None and received.envelope.kind is Kind.STATUS and received.envelope.round >= completed:
            return
    raise AssertionError(f"round {completed} did not complete within {WAIT:.0f} s")
