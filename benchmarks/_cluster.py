"""The topology of `scale.py --cluster`, the cluster tests' own (harness/, not copied): three "hosts"
(network namespaces on one bridge, harness/hosts.py), a NATS node on each (harness/nats_cluster.py),
`edgepfl aggregator --shard k/K` processes on hosts 2 and 3, and helpers to put a process on a
host (setns into its namespace) and to read a process's memory from /proc.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator

from harness.hosts import Hosts, HostsUnavailable, stop_process
from harness.nats_cluster import NatsCluster, node_config

REPOSITORY = Path(__file__).resolve().parents[1]
HOSTS = 3
CLONE_NEWNET = 0x40000000
NATS_BINARY = shutil.which("nats-server") or shutil.which("nats-server", path="/usr/sbin:/usr/local/sbin")


def unavailable() -> str | None:
    """Why the cluster cannot be built here (None when it can)."""
    if os.geteuid() != 0:
        return "--cluster needs root (it creates network namespaces)"
    if shutil.which("ip") is None:
        return "--cluster needs the ip command (iproute2)"
    if NATS_BINARY is None:
        return "--cluster needs nats-server (apt-get install nats-server)"
    return None


def enter_namespace(namespace: str | None) -> None:
    """Move the calling thread (and every thread it starts later) into `namespace`: called first
    thing in a fresh process, it puts the whole process on that host."""
    if namespace is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns {namespace}: {os.strerror(error)}")
    finally:
        os.close(fd)


def proc_status(pid: int | str, field_name: str) -> int | None:
    """A /proc/<pid>/status memory field (VmRSS, VmHWM) in bytes; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_of_process(process: int) -> int:
    """Device process `process` runs on host 1, 2, 3, 1, ..."""
    return process % HOSTS + 1


@dataclass
class Cluster:
    """The running hosts and NATS nodes; aggregators are added by `start_aggregators`."""

    hosts: Hosts
    nodes: NatsCluster
    aggregators: list[tuple[subprocess.Popen, Path]] = field(default_factory=list)

    def url(self, host: int) -> str:
        return self.nodes.urls[host - 1]

    def namespace(self, host: int) -> str:
        return self.hosts.namespace(host)

    @property
    def node_pids(self) -> dict[str, int]:
        return {f"nats-n{node.host}": node.process.pid for node in self.nodes.nodes if node.process is not None}

    def start_aggregators(self, shards: int, federation: str, logs: Path) -> None:
        """`edgepfl aggregator --shard k/K` on host 2, 3, 2, ... each on its host's node (`ip netns
        exec` execs the command, so the process id is the aggregator's)."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for shard in range(shards):
            host = shard % (HOSTS - 1) + 2
            log = logs / f"aggregator-{shard}.log"
            with open(log, "w") as output:
                process = self.hosts.spawn(host, [sys.executable, "-m", "coordinator.cli", "aggregator", "--shard",
                                                  f"{shard}/{shards}", "--broker", self.url(host), "--federation",
                                                  federation], env=env, stdout=output, stderr=subprocess.STDOUT)
            self.aggregators.append((process, log))

    def stop_aggregators(self, timeout: float = 60) -> list[str]:
        """Wait for the aggregators to finish (they do once the run finishes), stop any left; their logs' last lines."""
        tails = []
        for process, log in self.aggregators:
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_process(process)
            lines = log.read_text().strip().splitlines()
            tails.append(lines[-1] if lines else "")
        self.aggregators.clear()
        return tails


def mqtt_options(consumer_replicas: int | None, consumer_memory: bool) -> str:
    """Lines for the nodes' `mqtt` block beyond the tests' configuration: the replicas of the
    JetStream consumer NATS makes for every QoS 1 subscription (default: the stream's, 3 here)
    and whether it keeps them in memory instead of on disk."""
    lines = [f"  consumer_replicas: {consumer_replicas}\n"] if consumer_replicas else []
    return "".join(lines + (["  consumer_memory_storage: true\n"] if consumer_memory else []))


@contextlib.contextmanager
def cluster(workdir: Path, mqtt_extra: str = "") -> Iterator[Cluster]:
    """Three hosts with a NATS node each (harness/nats_cluster.py's configuration, `mqtt_extra`
    added to its `mqtt` block), removed (processes and namespaces) on exit."""
    with Hosts(HOSTS) as hosts:
        def config(host: int, store: Path) -> str:
            return node_config(hosts, host, HOSTS, store).replace("mqtt {\n", "mqtt {\n" + mqtt_extra)

        nodes = NatsCluster(hosts, workdir / "nats", config=config)
        try:
            nodes.start()
            yield Cluster(hosts, nodes)
        finally:
            nodes.stop()


__all__ = ["Cluster", "HostsUnavailable", "cluster", "enter_namespace", "host_of_process", "mqtt_options",
           "proc_status", "unavailable"]
