"""Several "hosts" on one machine: network namespaces joined by veth pairs to a bridge.

`Hosts(3)` creates, as root, the namespaces `epfl<pid>-h1` .. `-h3` and `epfl<pid>-br`; the bridge
lives in the `-br` namespace and each host's `eth0` (the other end of its veth pair) has the
address `10.77.0.<i>/24`. Nothing is added to the machine's own namespace, so these addresses
are seen only by processes inside the namespaces, and two test runs (each its own bridge) can use
the same subnet side by side.

A process runs on a host with `hosts.spawn(i, argv)` (`ip netns exec`, which also shows the host
the files of `/etc/netns/<namespace>/`: `add_name` gives every host an /etc/hosts entry, e.g. one
name for all the broker's nodes, as a DNS name with several addresses would); the test's own MQTT
clients run on a host inside `with hosts.inside(i):` (setns(2) on the calling thread; threads
started there, such as paho's network loop, stay in that host for good). `close()` kills every
process spawned here and deletes the namespaces (which deletes the veths in them); it runs on
any exit of the `with` block, also when a test fails. Namespaces left by a run that was itself
killed (its pid no longer alive) are removed by the next run.

Skipping: without root, iproute2 or network-namespace support (`hosts_or_skip`) the cluster
tests skip with the reason, except under CI=true, where they fail: CI runs as root with
nats-server installed, so a missing prerequisite there is a broken CI image, not a reason to
pass (the same rule as Mosquitto's in harness/brokers.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from collections.abc import Iterator, Sequence
from typing import NoReturn

SUBNET = "10.77.0"
PREFIX = "epfl"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns: {os.strerror(error)}")


ETC_NETNS = Path("/etc/netns")


def _remove_namespace(name: str) -> None:
    _ip("netns", "del", name, check=False)
    shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    with contextlib.suppress(OSError):
        ETC_NETNS.rmdir()  # only when no namespace has files there any more


def remove_stale_namespaces() -> None:
    """Delete namespaces named by this module whose creating process is gone."""
    listing = _ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({PREFIX}(\d+)-\w+)", listing, flags=re.MULTILINE):
        namespace, pid = name
        if not Path(f"/proc/{pid}").exists():
            _remove_namespace(namespace)


class Hosts:
    """`count` hosts on one bridge; use as a context manager (or call `start` and `close`)."""

    def __init__(self, count: int, subnet: str = SUBNET):
        if not 1 <= count <= 250:
            raise ValueError(f"count must be in 1..250, got {count}")
        self.count, self.subnet = count, subnet
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge_ns = f"{self.tag}-br"
        self.processes: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._lock = threading.Lock()

    def namespace(self, host: int) -> str:
        self._check(host)
        return f"{self.tag}-h{host}"

    def address(self, host: int) -> str:
        self._check(host)
        return f"{self.subnet}.{host}"

    def _check(self, host: int) -> None:
        if not 1 <= host <= self.count:
            raise ValueError(f"host must be in 1..{self.count}, got {host}")

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Hosts:
        if os.geteuid() != 0:
            raise HostsUnavailable("network namespaces need root (run the tests as root, as CI does)")
        if shutil.which("ip") is None:
            raise HostsUnavailable("the ip command (iproute2) is not installed")
        remove_stale_namespaces()
        try:
            self._add_namespace(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for host in range(1, self.count + 1):
                namespace = self.namespace(host)
                self._add_namespace(namespace)
                _ip("link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", f"h{host}",
                    "netns", self.bridge_ns)
                _ip("-n", self.bridge_ns, "link", "set", f"h{host}", "master", "br0", "up")
                _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                _ip("-n", namespace, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def close(self) -> None:
        """Kill every process spawned here, then delete the namespaces (and with them the veths)."""
        with self._lock:
            processes, self.processes = self.processes, []
        for process in processes:
            stop_process(process)
        for name in reversed(self._created):
            _remove_namespace(name)
        self._created.clear()

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_name(self, name: str, addresses: Sequence[str]) -> None:
        """Resolve `name` to `addresses` (in this order) for processes spawned on every host."""
        for host in range(1, self.count + 1):
            folder = ETC_NETNS / self.namespace(host)
            folder.mkdir(parents=True, exist_ok=True)
            hosts_file = folder / "hosts"
            if not hosts_file.exists():
                hosts_file.write_text("127.0.0.1 localhost\n")
            with hosts_file.open("a") as handle:
                handle.writelines(f"{address} {name}\n" for address in addresses)

    # -- running things on a host ------------------------------------------------------------
    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host` (`ip netns exec` execs it: the process id is the command's)."""
        return ["ip", "netns", "exec", self.namespace(host), *map(str, argv)]

    def spawn(self, host: int, argv: Sequence[str], **popen) -> subprocess.Popen:
        """Start `argv` on `host`; `close()` kills it if it is still running."""
        process = subprocess.Popen(self.command(host, argv), **popen)
        with self._lock:
            self.processes.append(process)
        return process

    def run(self, host: int, argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout)

    @contextlib.contextmanager
    def inside(self, host: int) -> Iterator[None]:
        """Run the block's network calls in `host`: sockets made here, and threads started here,
        belong to it for good (the calling thread returns to its own namespace at the end)."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.namespace(host)}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
            os.close(own)


def stop_process(process: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL after `timeout`; a SIGSTOPped process is continued first."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGCONT)
        process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)


def skip_or_fail(reason: str) -> NoReturn:
    """Skip with `reason`; under CI=true fail instead (CI must run these tests). Only tests call
    it: pytest is imported here, so that a benchmark needs none."""
    import pytest

    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@contextlib.contextmanager
def hosts_or_skip(count: int) -> Iterator[Hosts]:
    """`Hosts(count)`, started and closed around the block; skips (fails in CI) if impossible."""
    hosts = Hosts(count)
    try:
        hosts.start()
    except HostsUnavailable as exc:
        skip_or_fail(f"cannot build {count} test hosts: {exc}")
    try:
        yield hosts
    finally:
        hosts.close()
