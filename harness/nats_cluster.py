"""A NATS cluster for tests and benchmarks: one nats-server per test host (harness/hosts.py), routes between all,
JetStream (which NATS's MQTT layer keeps its sessions, retained messages and QoS 1 messages in,
replicated across the nodes) and an MQTT listener on each node.

Node i runs on host i as `n<i>` (`server_name`, which JetStream in a cluster needs), with its
own JetStream store folder (kept across `stop`/`start`, as a restarted machine keeps its disk)
and `max_payload` (`MAX_PAYLOAD`, NATS's default 1 MB). `start` waits until every node answers
`/healthz?js-server-only=true` on its monitoring port (the server and its JetStream are up; a
full `/healthz`, every stream and consumer current, took over a minute after a restart in one
run) and an MQTT CONNECT with a CONNACK: a restarted node can be healthy and still close MQTT
connections before their CONNACK while its JetStream catches up (seen in a full test run, right
after the failover test restarted node 2); `stop(kill=True)` is a crash.
A node's configuration may be given instead (`edgepfl broker-config --broker-kind nats`'s files).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from collections.abc import Callable

from .hosts import Hosts, skip_or_fail, stop_process

MQTT_PORT = 1883
CLIENT_PORT = 4222
ROUTE_PORT = 6222
MONITOR_PORT = 8222
MAX_PAYLOAD = 1 << 20
READY_TIMEOUT = 60.0
POLL_SECONDS = 0.2
CONNACK = 0x20


def nats_binary() -> str:
    """The nats-server command; skips (fails under CI=true) when it is not installed."""
    found = shutil.which("nats-server") or shutil.which("nats-server", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        skip_or_fail("nats-server is not installed (apt-get install nats-server)")
    return found


def cluster_block(hosts: Hosts, host: int, nodes: int, name: str = "edgepfl") -> str:
    """The `cluster` block of node `host`: its route listener and routes to every other node."""
    routes = ", ".join(f"nats-route://{hosts.address(other)}:{ROUTE_PORT}"
                       for other in range(1, nodes + 1) if other != host)
    return f"cluster {{\n  name: {name}\n  listen: {hosts.address(host)}:{ROUTE_PORT}\n  routes: [{routes}]\n}}\n"


def node_config(hosts: Hosts, host: int, nodes: int, store: Path, max_payload: int = MAX_PAYLOAD) -> str:
    address = hosts.address(host)
    return (f"server_name: n{host}\nlisten: {address}:{CLIENT_PORT}\nhttp: {address}:{MONITOR_PORT}\n"
            f"max_payload: {max_payload}\n"
            f"jetstream {{\n  store_dir: \"{store}\"\n  max_memory_store: 256MB\n  max_file_store: 2GB\n}}\n"
            f"{cluster_block(hosts, host, nodes)}"
            f"mqtt {{\n  listen: {address}:{MQTT_PORT}\n  stream_replicas: {min(nodes, 3)}\n}}\n")


class NatsNode:
    """One nats-server on a host, from `config` (a file, or the text of one written to `workdir`)."""

    def __init__(self, hosts: Hosts, host: int, workdir: Path, config: str | Path):
        self.hosts, self.host, self.workdir = hosts, host, workdir
        self.log = workdir / "nats.log"
        workdir.mkdir(parents=True, exist_ok=True)
        if isinstance(config, Path):
            self.config = config
        else:
            self.config = workdir / "nats.conf"
            self.config.write_text(config)
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return self.hosts.address(self.host)

    @property
    def url(self) -> str:
        return f"mqtt://{self.address}:{MQTT_PORT}"

    def start(self) -> None:
        log = open(self.log, "a")
        self.process = self.hosts.spawn(self.host, [nats_binary(), "-c", str(self.config)], stdout=log,
                                        stderr=subprocess.STDOUT)
        log.close()

    def stop(self, kill: bool = False) -> None:
        """Stop the node: SIGKILL (a crash: nothing is flushed, no client hears a goodbye) or SIGTERM."""
        if self.process is None:
            return
        if kill:
            self.process.kill()
            self.process.wait(timeout=10)
        else:
            stop_process(self.process)
        self.process = None

    def healthy(self) -> bool:
        """The node's /healthz says ok for the server and its JetStream (not yet every stream and consumer)."""
        url = f"http://{self.address}:{MONITOR_PORT}/healthz?js-server-only=true"
        with self.hosts.inside(self.host):
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    return json.loads(response.read()).get("status") == "ok"
            except (OSError, urllib.error.URLError, ValueError):
                return False

    def answers_mqtt(self) -> bool:
        """An MQTT 3.1.1 CONNECT (clean session) on the node's MQTT port gets a CONNACK, accepting
        or refusing it (a node with accounts refuses an anonymous client: its MQTT layer is up)."""
        client_id = f"ready-probe-n{self.host}".encode()
        body = b"\x00\x04MQTT\x04\x02\x00\x0a" + len(client_id).to_bytes(2, "big") + client_id
        with self.hosts.inside(self.host):
            try:
                with socket.create_connection((self.address, MQTT_PORT), timeout=2) as connection:
                    connection.sendall(bytes([0x10, len(body)]) + body)
                    answered = connection.makefile("rb").read(4)  # CONNACK is 4 bytes; b"" if the node hung up
                    connack = len(answered) == 4 and answered[0] == CONNACK
                    if connack:
                        connection.sendall(b"\xe0\x00")  # DISCONNECT
                    return connack
            except OSError:
                return False

    def wait_healthy(self, timeout: float = READY_TIMEOUT) -> None:
        """Until /healthz says ok and an MQTT CONNECT gets its CONNACK; between looks, wait on the
        node's process, so a node that exits fails at once with its log instead of after `timeout`."""
        assert self.process is not None, "the node is not started"
        deadline = time.monotonic() + timeout
        while not (self.healthy() and self.answers_mqtt()):
            try:
                code = self.process.wait(timeout=min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise AssertionError(f"nats node n{self.host} not healthy with MQTT up in {timeout:.0f} s; "
                                         f"its log:\n{self.tail()}") from None
                continue
            raise AssertionError(f"nats node n{self.host} exited with {code}; its log:\n{self.tail()}")

    def stream_leader(self, stream: str) -> str | None:
        """The server name of the JetStream leader of `stream` (e.g. `$MQTT_msgs`), as this node sees it."""
        url = f"http://{self.address}:{MONITOR_PORT}/jsz?accounts=true&streams=true"
        with self.hosts.inside(self.host), urllib.request.urlopen(url, timeout=5) as response:
            details = json.loads(response.read()).get("account_details") or []
        for account in details:
            for found in account.get("stream_detail") or []:
                if found.get("name") == stream:
                    return (found.get("cluster") or {}).get("leader")
        return None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text()[-chars:] if self.log.exists() else "(no log)"


class NatsCluster:
    """Nodes on hosts 1..len(hosts); `urls` are their MQTT addresses, node i+1 at index i.
    `config(host, store folder)` gives node `host`'s configuration: its text or a file."""

    def __init__(self, hosts: Hosts, workdir: Path, nodes: int | None = None,
                 config: Callable[[int, Path], str | Path] | None = None):
        nodes = nodes or hosts.count
        make = config or (lambda host, store: node_config(hosts, host, nodes, store))
        self.nodes = [NatsNode(hosts, host, workdir / f"n{host}", make(host, workdir / f"n{host}" / "store"))
                      for host in range(1, nodes + 1)]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def node(self, host: int) -> NatsNode:
        return self.nodes[host - 1]

    def start(self) -> NatsCluster:
        for node in self.nodes:
            node.start()
        for node in self.nodes:
            node.wait_healthy()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def wait_until(condition: Callable[[], bool], timeout: float, message: Callable[[], str]) -> None:
    """Look at `condition` every POLL_SECONDS until true (for state with nothing to wait on, such
    as a transport's counters); fail with `message` after `timeout`."""
    deadline, pause = time.monotonic() + timeout, threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message())
        pause.wait(POLL_SECONDS)
