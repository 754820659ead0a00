"""A ready NATS setup for one federation (`edgepfl broker-config --broker-kind nats`): one
nats-server configuration per cluster node, their shared accounts and permissions, credentials.

NATS speaks MQTT 3.1.1 on its `mqtt` listener and keeps MQTT sessions, retained messages and
QoS 1 messages in JetStream, replicated over the cluster. `generate_nats` writes into one folder:

- `nodes/n<i>.conf`, one per address in `nodes`: `server_name n<i>`, the NATS client port (4222)
  and the monitoring port (8222) on that address, the JetStream store `store/n<i>`, the `cluster`
  block (routes to every other node, authenticated with a generated route password; left out for
  a single node), the `mqtt` block (the MQTT port; `stream_replicas` = min(nodes, 3), so a
  3-node cluster keeps the MQTT state on all three and survives the loss of one node) and
  `max_payload` 8 MB (see docs/SCALING.md: NATS 2.9 does not apply it to MQTT publishes; newer servers
  may), then `include accounts.conf`.
- `accounts.conf` (mode 0600): the account `EDGEPFL` with JetStream enabled, and its users
  `coordinator` and one per device (username = device id), bcrypt-hashed passwords where
  Python's `crypt` module has bcrypt, in the clear (still 0600) otherwise. Permissions equal
  the Mosquitto ACLs of `mosquitto.render_acl`, written as NATS subjects (MQTT topic `a/b`
  is subject `a.b`, `+` is `*`, `#` is `>`; NATS 2.9 refuses a `.` in an MQTT topic, so the
  federation name and device ids may not have one here; a `#` rule allows the parent subject
  too, as NATS subscribes both for an MQTT `a/#`): the coordinator publishes
  `edgepfl.<fed>.down.>` and subscribes `edgepfl.<fed>.up.>`; a device publishes only
  `edgepfl.<fed>.up.<id>.>` and subscribes only `edgepfl.<fed>.down.all.>` and
  `edgepfl.<fed>.down.<id>.>`. Every MQTT user may also subscribe `$MQTT.sub.>`: the server
  delivers QoS 1 messages to an MQTT subscription through a JetStream consumer whose deliver
  subject is there, under the client's own permissions. Nothing else of `$MQTT.>` or `$JS.>`
  is granted: the server's own MQTT bookkeeping runs with its internal client.
- `credentials.json` and `devices/<id>.json` (mode 0600): the same documents as for Mosquitto
  (`mosquitto`), `url` = the first node's MQTT address.

Unlike Mosquitto's `use_username_as_clientid`, NATS does not bind the MQTT client id to the
account: a device cannot write or read another device's topics, but one that connects with
another's client id takes over (closes) that device's session.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edge_sdk.protocol import COORDINATOR, Topics
from edge_sdk.signing import new_key

from .mosquitto import (Account, BrokerConfigError, _write_secret, accounts_with_aggregators, new_password,
                            parse_devices, topic_rules)

ACCOUNT = "EDGEPFL"
CLIENT_PORT = 4222
ROUTE_PORT = 6222
MONITOR_PORT = 8222
MAX_PAYLOAD = "8MB"
MQTT_DELIVERY = "$MQTT.sub.>"
"""Where the server delivers QoS 1 messages to an MQTT subscription (a JetStream consumer's deliver
subject): every MQTT user subscribes there."""


@dataclass
class NatsSetup:
    """What `generate_nats` wrote."""

    out: Path
    federation: str
    url: str
    node_configs: list[Path]
    accounts_file: Path
    credentials: Path
    accounts: dict[str, Account]
    files: list[Path] = field(default_factory=list)

    @property
    def start_commands(self) -> list[str]:
        return [f"nats-server -c {config}" for config in self.node_configs]


def subject(topic: str) -> str:
    """The NATS subject of an MQTT topic or filter (without `.`): levels joined by `.`, `+` as `*`,
    `#` as `>`."""
    return ".".join({"+": "*", "#": ">"}.get(level, level) for level in topic.split("/"))


def check_no_dot(kind: str, name: str) -> None:
    """NATS 2.9 refuses MQTT topics with a `.` (newer servers map it to `//`): ids in topics must not have one."""
    if "." in name:
        raise BrokerConfigError(f"{kind} {name!r} has a '.': NATS (2.9) refuses '.' in MQTT topics, and edgepfl "
                                f"puts the federation name and device ids in its topics; use '-' or '_' instead")


def permissions(federation: str, account: str, shards: int = 0) -> dict[str, list[str]]:
    """The subjects `account` may publish and subscribe: `mosquitto.topic_rules` (the Mosquitto
    ACL's), plus QoS 1 delivery. An MQTT filter `a/#` also matches `a` itself, and NATS subscribes
    both `a` and `a.>` for it, so each `#` rule allows both subjects."""
    write, read = topic_rules(federation, account, shards)

    def subjects(filters: list[str]) -> list[str]:
        return list(dict.fromkeys(item for topic in filters
                                  for item in (subject(topic.removesuffix("/#")), subject(topic))))

    return {"publish": subjects(write), "subscribe": subjects(read) + [MQTT_DELIVERY]}


def hash_password(password: str) -> str:
    """A bcrypt hash nats-server accepts, where Python's crypt module has bcrypt; else the password."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt
        hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 11))
    except (ImportError, AttributeError, ValueError, OSError):
        return password
    return hashed if hashed and hashed.startswith("$2") else password


def _quoted(value: str) -> str:
    return json.dumps(value)


def render_accounts(federation: str, accounts: dict[str, Account], shards: int = 0) -> str:
    lines = [f"# edgepfl federation {federation!r}: generated by `edgepfl broker-config --broker-kind nats`.",
             "# Usernames are device ids; a device may only publish under its own upstream id.",
             "accounts {", f"  {ACCOUNT} {{", "    jetstream: enabled", "    users: ["]
    for name, account in accounts.items():
        allowed = permissions(federation, name, shards)
        lines += [f"      {{user: {_quoted(account.username)}, password: {_quoted(hash_password(account.password))},",
                  "       allowed_connection_types: [\"MQTT\"],",
                  f"       permissions: {{publish: {json.dumps(allowed['publish'])}, "
                  f"subscribe: {json.dumps(allowed['subscribe'])}}}}}"]
    lines += ["    ]", "  }", "}"]
    return "\n".join(lines) + "\n"


def render_node(out: Path, index: int, nodes: Sequence[str], mqtt_port: int, route_password: str) -> str:
    address = nodes[index - 1]
    lines = [
        f"# Generated by `edgepfl broker-config --broker-kind nats`; start with: nats-server -c "
        f"{out / 'nodes' / f'n{index}.conf'}",
        f"server_name: n{index}",
        f"listen: {address}:{CLIENT_PORT}",
        f"http: {address}:{MONITOR_PORT}",
        "# NATS 2.9 does not apply max_payload to MQTT publishes; a newer server may: keep the coordinator's",
        "# --chunk-size and the devices' update size below it",
        f"max_payload: {MAX_PAYLOAD}",
        "jetstream {",
        f"  store_dir: {_quoted(str(out / 'store' / f'n{index}'))}",
        "}",
    ]
    if len(nodes) > 1:
        routes = ", ".join(f"nats-route://route:{route_password}@{other}:{ROUTE_PORT}"
                           for number, other in enumerate(nodes, 1) if number != index)
        lines += ["cluster {", "  name: edgepfl", f"  listen: {address}:{ROUTE_PORT}",
                  f"  authorization {{ user: route, password: {_quoted(route_password)} }}",
                  f"  routes: [{routes}]", "}"]
    lines += [
        "mqtt {",
        f"  listen: {address}:{mqtt_port}",
        "  # sessions, retained and QoS 1 messages are kept on this many nodes",
        f"  stream_replicas: {min(len(nodes), 3)}",
        "}",
        "include ../accounts.conf",
    ]
    return "\n".join(lines) + "\n"


def generate_nats(out: str | Path, federation: str, devices: str | Sequence[str], port: int = 1883, *,
                  nodes: Sequence[str] = ("127.0.0.1",), force: bool = False, shards: int = 0) -> NatsSetup:
    """Write nats-server configurations (one per node address), accounts with per-device
    permissions and credentials for `federation` into `out` (with `shards` K, also the accounts
    of the shard aggregators `aggregator-0..K-1`)."""
    try:
        Topics(federation)
    except ValueError as exc:
        raise BrokerConfigError(str(exc)) from None
    ids = accounts_with_aggregators(parse_devices(devices), shards)
    check_no_dot("federation name", federation)
    for device in ids:
        check_no_dot("device id", device)
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise BrokerConfigError(f"port must be in 1..65535, got {port!r}")
    nodes = [node.strip() for node in nodes]
    if not nodes or any(not node or any(c.isspace() or c in ",:" for c in node) for node in nodes):
        raise BrokerConfigError(f"--nodes must be comma-separated addresses (IPv4 or names), got {nodes!r}")
    if len(set(nodes)) != len(nodes):
        raise BrokerConfigError(f"a node address is listed twice in {','.join(nodes)!r}")

    out = Path(out).absolute()
    accounts_file, credentials = out / "accounts.conf", out / "credentials.json"
    existing = [p for p in (accounts_file, credentials) if p.exists()]
    if existing and not force:
        raise BrokerConfigError(f"{existing[0]} already exists (pass --force to replace the whole setup, "
                                f"which changes every password)")
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    for folder in ("nodes", "devices"):
        if force and (out / folder).exists():
            shutil.rmtree(out / folder)
        (out / folder).mkdir(mode=0o700, exist_ok=True)

    accounts = {name: Account(name, new_password(), signing_key=None if name == COORDINATOR else new_key())
                for name in [COORDINATOR, *ids]}
    _write_secret(accounts_file, render_accounts(federation, accounts, shards))
    route_password = new_password()
    node_configs = []
    for index in range(1, len(nodes) + 1):
        path = out / "nodes" / f"n{index}.conf"
        _write_secret(path, render_node(out, index, nodes, port, route_password))
        node_configs.append(path)

    url = f"mqtt://{nodes[0]}:{port}"

    def entry(account: Account) -> dict[str, str]:
        item = {"username": account.username, "password": account.password}
        if account.signing_key is not None:
            item["signing_key"] = account.signing_key
        return item

    document = {"federation": federation, "url": url, "coordinator": entry(accounts[COORDINATOR]),
                "devices": {d: entry(accounts[d]) for d in ids}}
    _write_secret(credentials, json.dumps(document, indent=2) + "\n")
    device_files = [out / "devices" / f"{d}.json" for d in ids]
    for device, path in zip(ids, device_files, strict=True):
        _write_secret(path, json.dumps({"federation": federation, "url": url,
                                        "devices": {device: entry(accounts[device])}}, indent=2) + "\n")
    files = [*node_configs, accounts_file, credentials, *device_files]
    return NatsSetup(out, federation, url, node_configs, accounts_file, credentials, accounts, files)


def describe_nats(setup: NatsSetup) -> str:
    """What was written and how to use it: the `broker-config --broker-kind nats` output."""
    device = next(name for name in setup.accounts if name != COORDINATOR)
    lines = [f"wrote {len(setup.accounts)} accounts (coordinator, {', '.join(list(setup.accounts)[1:])}) for "
             f"federation {setup.federation!r} and {len(setup.node_configs)} NATS node(s) to {setup.out}:"]
    lines += [f"  {path}" for path in setup.files]
    lines += ["", "start each node (on its own host):", *[f"  {command}" for command in setup.start_commands],
              "coordinator (any node's MQTT address):",
              f"  edgepfl coordinator --broker {setup.url} --federation {setup.federation} --mqtt-protocol 3.1.1 "
              f"--credentials {setup.credentials} ...",
              f"device {device} (copy {setup.out / 'devices' / (device + '.json')} to it, never "
              f"{setup.credentials.name}; --broker: the node nearest to it):",
              f"  edgepfl client --broker {setup.url} --federation {setup.federation} --mqtt-protocol 3.1.1 "
              f"--client-id {device} --credentials {device}.json ..."]
    return "\n".join(lines)
