"""A ready Mosquitto setup for one federation: accounts, topic ACLs and, optionally, mutual TLS.

`generate` writes into one folder:

- `mosquitto.conf`: one listener, no anonymous access, the password and ACL files below, no
  persistence, a log file next to it; with TLS: the listener's CA, certificate and key,
  `require_certificate true` (mutual TLS) and `use_identity_as_username true`, TLS 1.2 or newer:
  the certificate's CN is the account (CN = device id = username = MQTT client id), so a device
  presenting another device's certificate acts as that other device, never as the account it
  claims, whatever password it sends. Mosquitto checks no password on such a listener; the
  password file is still written (the listener has no other) so the same accounts work without
  TLS (`--tls` dropped, or a plain listener added on localhost).
- `passwords`: the accounts `coordinator` and one per device (username = device id), with
  random passwords hashed by `mosquitto_passwd`.
- `acl`: the coordinator writes `edgepfl/<fed>/down/#` and reads `edgepfl/<fed>/up/#`; a device
  writes only `edgepfl/<fed>/up/<its id>/#` and reads only `edgepfl/<fed>/down/all/#` and
  `edgepfl/<fed>/down/<its id>/#`. Usernames equal device ids, so the broker itself checks that
  the id in a topic is the sender's. `use_username_as_clientid` makes the MQTT client id the
  username, so one account cannot knock another's connection off by reusing its client id.
  With `shards` K > 0 (sharded aggregation), a device also writes its updates to its shard's
  topic `edgepfl/<fed>/shard-<k>/<its id>/train_res` (k = `shard_of(id, K)`), and accounts
  `aggregator-0` .. `aggregator-<K-1>` (listed with the devices in `credentials.json`) write
  `up/<their id>/#`, read the downstream broadcasts and their own downstream topics, and read
  `shard-<k>/+/train_res` of their shard only.
- `credentials.json` (mode 0600): `{"coordinator": {"username", "password"}, "devices": {id:
  {"username", "password", "signing_key"}}}`: `signing_key` (64 hex digits) is the device's
  message-signing key (`edge_sdk.signing`): a device seals its uploads with it and the
  coordinator, reading the whole file, verifies them; with TLS every account also has `ca_file`, `cert_file` and
  `key_file` (absolute paths); top-level `federation` and `url` say where to connect.
- `devices/<id>.json` (mode 0600): the same document with that device's entry only, the file to
  copy to the device (`edgepfl client --credentials <id>.json`): its password and signing key,
  and no other account's.
- with TLS, `tls/`: `ca.crt` and `ca.key`, `server.crt`/`server.key` (SANs: localhost,
  127.0.0.1, the bind host and `sans`), and `clients/<account>.crt`/`.key` per account.

The per-client queue has no limit (`max_queued_messages 0`, `max_queued_bytes 0`): the
coordinator reads under flow control, so the broker keeps a round's uploads for it (in memory:
up to devices x update size) and a full queue would drop QoS 1 uploads for good.

Persistence is off on purpose: every edgepfl session is clean (nothing is queued for offline
clients), the coordinator publishes its retained status again on every (re)connection and its
checkpoint is the state that matters; a persisted broker would only bring back a stale status.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edge_sdk.protocol import BROADCAST, COORDINATOR, Kind, Topics, aggregator_id, check_client_id, shard_of_aggregator
from edge_sdk.signing import new_key

from ..shards.sharding import shard_of

CA_DAYS = 3650
LEAF_DAYS = 825
SBIN = "/usr/sbin:/usr/local/sbin:/opt/homebrew/sbin:/opt/homebrew/bin"


class BrokerConfigError(ValueError):
    """A bad argument, a missing tool or a failed generation step; the message says which."""


@dataclass
class Account:
    username: str
    password: str
    cert_file: Path | None = None
    key_file: Path | None = None
    signing_key: str | None = None
    """A device's message-signing key (hex, `edge_sdk.signing`); the coordinator has none."""


@dataclass
class BrokerSetup:
    """What `generate` wrote."""

    out: Path
    federation: str
    url: str
    config: Path
    passwords: Path
    acl: Path
    credentials: Path
    accounts: dict[str, Account]
    ca_file: Path | None = None
    files: list[Path] = field(default_factory=list)

    @property
    def start_command(self) -> str:
        return f"mosquitto -c {self.config}"


def find_tool(name: str, hint: str) -> str:
    """The path of a command-line tool (also looked for in the sbin folders), else a clear error."""
    found = shutil.which(name) or shutil.which(name, path=SBIN)
    if found is None:
        raise BrokerConfigError(f"{name} not found on PATH or in {SBIN}: {hint}")
    return found


def parse_devices(devices: str | Sequence[str]) -> list[str]:
    """Device ids from a comma-separated string or a list; each one checked, no duplicates."""
    ids = [d.strip() for d in devices.split(",")] if isinstance(devices, str) else [d.strip() for d in devices]
    if not ids or ids == [""]:
        raise BrokerConfigError("give at least one device id (--devices a,b,c)")
    seen: set[str] = set()
    for device in ids:
        if not device:
            raise BrokerConfigError(f"empty device id in {','.join(ids)!r}")
        try:
            check_client_id(device)
        except ValueError as exc:
            raise BrokerConfigError(str(exc)) from None
        if device in seen:
            raise BrokerConfigError(f"device id {device!r} is listed twice")
        seen.add(device)
    return ids


def topic_rules(federation: str, account: str, shards: int = 0) -> tuple[list[str], list[str]]:
    """(write, read) topic filters of `account` in `federation`: the coordinator writes downstream
    and reads upstream; a device writes under its own upstream id (with `shards`, also its
    updates to its shard's topic) and reads the broadcasts and its own downstream topics; a shard
    aggregator `aggregator-<k>` is a device that also reads its shard's updates. Every broker
    setup (Mosquitto ACLs, NATS permissions) is written from these rules."""
    topics = Topics(federation)
    prefix = topics.prefix
    if account == COORDINATOR:
        return [f"{prefix}/down/#"], [f"{prefix}/up/#"]
    write = [f"{prefix}/up/{account}/#"]
    read = [f"{prefix}/down/{BROADCAST}/#", f"{prefix}/down/{account}/#"]
    shard = shard_of_aggregator(account) if shards else None
    if shard is not None:
        read.append(topics.shard_updates(shard))
    elif shards:
        write.append(topics.shard(shard_of(account, shards), account, Kind.TRAIN_RES))
    return write, read


def accounts_with_aggregators(ids: list[str], shards: int) -> list[str]:
    """The device ids and, with `shards` K, the aggregator accounts `aggregator-0..K-1`; refuses
    a K out of range and a device id reserved for an aggregator."""
    if not isinstance(shards, int) or not 0 <= shards <= 1024:
        raise BrokerConfigError(f"shards must be between 0 and 1024, got {shards!r}")
    reserved = [d for d in ids if shard_of_aggregator(d) is not None]
    if reserved:
        raise BrokerConfigError(f"device id {reserved[0]!r} is reserved for a shard aggregator")
    return ids + [aggregator_id(k) for k in range(shards)]


def render_acl(federation: str, devices: Sequence[str], shards: int = 0) -> str:
    """Mosquitto ACL lines: per-user blocks, usernames = `coordinator` and the device ids (and,
    with `shards`, the shard aggregators `aggregator-<k>`), from `topic_rules`."""
    lines = [
        f"# edgepfl federation {federation!r}: generated by `edgepfl broker-config`.",
        "# Usernames are device ids; a device may only write under its own upstream id.",
    ]
    for account in (COORDINATOR, *devices):
        write, read = topic_rules(federation, account, shards)
        lines += ["", f"user {account}", *(f"topic write {t}" for t in write), *(f"topic read {t}" for t in read)]
    return "\n".join(lines) + "\n"


QUEUE_SETTINGS = (
    "# the coordinator reads under flow control, so the broker queues a round's uploads for it",
    "# (up to devices x update size, in memory); a full queue would drop QoS 1 uploads",
    "max_queued_messages 0",
    "max_queued_bytes 0",
)


def render_config(out: Path, port: int, host: str, user: str, tls: bool) -> str:
    lines = [
        "# Generated by `edgepfl broker-config`; start with: mosquitto -c " + str(out / "mosquitto.conf"),
        "per_listener_settings false",
        "allow_anonymous false",
        f"password_file {out / 'passwords'}",
        f"acl_file {out / 'acl'}",
        "# every edgepfl session is clean and the coordinator re-publishes its retained status",
        "persistence false",
        f"log_dest file {out / 'mosquitto.log'}",
        "log_timestamp true",
        *QUEUE_SETTINGS,
        "# mosquitto only switches to this account when started as root",
        f"user {user}",
        "",
        f"listener {port} {host}",
        "# the MQTT client id is the username: no account can take over another's connection",
        "use_username_as_clientid true",
    ]
    if tls:
        tls_dir = out / "tls"
        lines += [
            f"cafile {tls_dir / 'ca.crt'}",
            f"certfile {tls_dir / 'server.crt'}",
            f"keyfile {tls_dir / 'server.key'}",
            "tls_version tlsv1.2",
            "# mutual TLS: a client certificate signed by the CA is the account; its CN (the device id)",
            "# becomes the username, so the ACLs bind the certificate to the device's own topics and a",
            "# password of another account does not help (Mosquitto checks no password here)",
            "require_certificate true",
            "use_identity_as_username true",
        ]
    return "\n".join(lines) + "\n"


def _url(host: str, port: int, tls: bool) -> str:
    connect = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if ":" in connect:
        connect = f"[{connect}]"
    return f"{'mqtts' if tls else 'mqtt'}://{connect}:{port}"


def _write_secret(path: Path, text: str) -> None:
    """Write `text` to a file that is created with mode 0600 (never readable by others)."""
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def new_password() -> str:
    """A random password of 32 URL-safe characters that does not start with "-" (a command line
    would read `--password -x...` as a flag)."""
    password = secrets.token_urlsafe(24)
    return password if not password.startswith("-") else "A" + password[1:]


def _hash_passwords(tool: str, path: Path, accounts: dict[str, Account]) -> None:
    """Write `user:password` lines (0600) and let `mosquitto_passwd -U` hash them in place, so
    no password appears on a command line."""
    _write_secret(path, "".join(f"{a.username}:{a.password}\n" for a in accounts.values()))
    result = subprocess.run([tool, "-U", str(path)], capture_output=True, text=True)
    hashed = path.read_text().splitlines() if path.exists() else []
    if result.returncode != 0 or len(hashed) != len(accounts) or not all(":$" in line for line in hashed):
        path.unlink(missing_ok=True)  # never leave plain-text passwords behind
        raise BrokerConfigError(f"{tool} -U failed to hash {path}: {(result.stderr or result.stdout).strip()}")
    os.chmod(path, 0o600)


# -- certificates --------------------------------------------------------------------------------

def _san_entries(names: Sequence[str]) -> list[str]:
    entries = []
    for name in dict.fromkeys(names):
        try:
            entries.append(f"IP:{ipaddress.ip_address(name)}")
        except ValueError:
            entries.append(f"DNS:{name}")
    return entries


class OpensslCA:
    """A certificate authority driven by the `openssl` command line (EC P-256 keys)."""

    def __init__(self, openssl: str, cert: Path, key: Path):
        self.openssl, self.cert, self.key = openssl, cert, key

    @classmethod
    def create(cls, openssl: str, directory: Path, common_name: str) -> OpensslCA:
        cert, key = directory / "ca.crt", directory / "ca.key"
        extensions = ("basicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign,cRLSign\n"
                      "subjectKeyIdentifier = hash\n")
        with tempfile.TemporaryDirectory() as scratch:
            cnf = _openssl_cnf(Path(scratch), common_name, extensions)
            _run(openssl, "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-sha256", "-days", str(CA_DAYS), "-config", cnf, "-extensions", "ext",
                 "-keyout", key, "-out", cert)
        _fix_modes(cert, key)
        return cls(openssl, cert, key)

    def issue(self, directory: Path, name: str, common_name: str, *, server: bool,
              sans: Sequence[str] = ()) -> tuple[Path, Path]:
        cert, key = directory / f"{name}.crt", directory / f"{name}.key"
        extensions = ("basicConstraints = critical,CA:FALSE\nkeyUsage = critical,digitalSignature,keyAgreement\n"
                      f"extendedKeyUsage = {'serverAuth' if server else 'clientAuth'}\n"
                      "subjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid,issuer\n")
        if sans:
            extensions += f"subjectAltName = {','.join(_san_entries(sans))}\n"
        with tempfile.TemporaryDirectory() as scratch:
            cnf = _openssl_cnf(Path(scratch), common_name, extensions)
            csr = Path(scratch) / "request.csr"
            _run(self.openssl, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-config", cnf, "-keyout", key, "-out", csr)
            _run(self.openssl, "x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key,
                 "-set_serial", str(secrets.randbits(63) + 1), "-sha256", "-days", str(LEAF_DAYS),
                 "-extfile", cnf, "-extensions", "ext", "-out", cert)
        _fix_modes(cert, key)
        return cert, key


def _openssl_cnf(scratch: Path, common_name: str, extensions: str) -> Path:
    cnf = scratch / "openssl.cnf"
    cnf.write_text(f"[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = {common_name}\n[ext]\n{extensions}")
    return cnf


def _run(*command: str | Path) -> None:
    # umask 077: private keys are never readable by others, not even for a moment
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, umask=0o077)
    if result.returncode != 0:
        raise BrokerConfigError(f"{' '.join(map(str, command[:2]))} failed: {result.stderr.strip()}")


def _fix_modes(cert: Path, key: Path) -> None:
    os.chmod(key, 0o600)
    os.chmod(cert, 0o644)


class CryptographyCA:
    """The same CA with the `cryptography` package, for machines without the openssl command."""

    def __init__(self, cert: Path, key: Path):
        self.cert, self.key = cert, key

    @classmethod
    def create(cls, directory: Path, common_name: str) -> CryptographyCA:
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        name = _x509_name(common_name)
        builder = _builder(name, name, key.public_key(), CA_DAYS)
        builder = (builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .add_extension(_key_usage(ca=True), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
        _save(directory / "ca.crt", directory / "ca.key", builder, key, key)
        return cls(directory / "ca.crt", directory / "ca.key")

    def issue(self, directory: Path, name: str, common_name: str, *, server: bool,
              sans: Sequence[str] = ()) -> tuple[Path, Path]:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID

        ca_cert = x509.load_pem_x509_certificate(self.cert.read_bytes())
        ca_key = serialization.load_pem_private_key(self.key.read_bytes(), password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{self.key}: the CA key is not an elliptic-curve key (this CA made its key on P-256)")
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = _builder(_x509_name(common_name), ca_cert.subject, key.public_key(), LEAF_DAYS)
        builder = (builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(_key_usage(ca=False), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                  critical=False))
        if sans:
            alt = []
            for entry in _san_entries(sans):
                kind, value = entry.split(":", 1)
                alt.append(x509.IPAddress(ipaddress.ip_address(value)) if kind == "IP" else x509.DNSName(value))
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
        _save(cert_path, key_path, builder, key, ca_key)
        return cert_path, key_path


def _x509_name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject, issuer, public_key, days: int):
    import datetime

    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _key_usage(*, ca: bool):
    from cryptography import x509

    return x509.KeyUsage(digital_signature=not ca, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=not ca, key_cert_sign=ca, crl_sign=ca,
                         encipher_only=False, decipher_only=False)


def _save(cert_path: Path, key_path: Path, builder, key, signing_key) -> None:
    from cryptography.hazmat.primitives import hashes, serialization

    certificate = builder.sign(signing_key, hashes.SHA256())
    _write_secret(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()).decode())
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    _fix_modes(cert_path, key_path)


def certificate_authority(directory: Path, common_name: str):
    """A new CA in `directory`: with the openssl command if there is one, else `cryptography`."""
    directory.mkdir(parents=True, exist_ok=True)
    openssl = shutil.which("openssl")
    if openssl is not None:
        return OpensslCA.create(openssl, directory, common_name)
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise BrokerConfigError("--tls needs the openssl command (apt-get install openssl) "
                                "or the cryptography package (pip install cryptography)") from None
    return CryptographyCA.create(directory, common_name)


# -- the whole setup -----------------------------------------------------------------------------

def generate(
    out: str | Path,
    federation: str,
    devices: str | Sequence[str],
    port: int,
    *,
    host: str = "127.0.0.1",
    tls: bool = False,
    sans: Sequence[str] = (),
    user: str | None = None,
    force: bool = False,
    shards: int = 0,
) -> BrokerSetup:
    """Write a Mosquitto configuration, accounts, ACLs, credentials and (with `tls`) certificates
    for `federation` into `out`. `user` is the account Mosquitto runs as when started as root
    (default: whoever runs this; as root, the broker's files are handed to `user`)."""
    try:
        Topics(federation)
    except ValueError as exc:
        raise BrokerConfigError(str(exc)) from None
    ids = parse_devices(devices)
    ids = accounts_with_aggregators(ids, shards)
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise BrokerConfigError(f"port must be in 1..65535, got {port!r}")
    if not host or any(c.isspace() for c in host):
        raise BrokerConfigError(f"invalid bind host {host!r}")
    for name in sans:
        if not name or any(c.isspace() or c == "," for c in name):
            raise BrokerConfigError(f"invalid certificate name {name!r}")
    current = pwd.getpwuid(os.geteuid()).pw_name
    user = user or current
    try:
        owner = pwd.getpwnam(user)
    except KeyError:
        raise BrokerConfigError(f"no such user {user!r} (--user: the account Mosquitto runs as)") from None
    if user != current and os.geteuid() != 0:
        raise BrokerConfigError(f"only root can hand the broker's files to {user!r}; run as root or drop --user")
    passwd_tool = find_tool("mosquitto_passwd", "install Mosquitto (apt-get install mosquitto, brew install "
                                                "mosquitto); it hashes the password file")

    out = Path(out).absolute()
    config, passwords, acl, credentials = (out / n for n in ("mosquitto.conf", "passwords", "acl", "credentials.json"))
    existing = [p for p in (config, passwords, acl, credentials) if p.exists()]
    if existing and not force:
        raise BrokerConfigError(f"{existing[0]} already exists (pass --force to replace the whole setup, "
                                f"which changes every password)")
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    tls_dir = out / "tls"
    if force and tls_dir.exists():
        shutil.rmtree(tls_dir)

    accounts = {name: Account(name, new_password(), signing_key=None if name == COORDINATOR else new_key())
                for name in [COORDINATOR, *ids]}
    _hash_passwords(passwd_tool, passwords, accounts)
    _write_secret(acl, render_acl(federation, ids, shards))
    config.write_text(render_config(out, port, host, user, tls))
    broker_files = [out, config, passwords, acl]
    ca_file = None
    if tls:
        tls_dir.mkdir(mode=0o700)
        ca = certificate_authority(tls_dir, f"edgepfl {federation} CA")
        bind = [] if host in ("0.0.0.0", "::") else [host]
        server = ca.issue(tls_dir, "server", bind[0] if bind else "localhost", server=True,
                          sans=["localhost", "127.0.0.1", *bind, *sans])
        clients_dir = tls_dir / "clients"
        clients_dir.mkdir(mode=0o700)
        for account in accounts.values():
            account.cert_file, account.key_file = ca.issue(clients_dir, account.username, account.username,
                                                           server=False)
        ca_file = ca.cert
        broker_files += [tls_dir, ca.cert, *server]
    log_file = out / "mosquitto.log"
    log_file.touch(mode=0o600)
    broker_files.append(log_file)

    url = _url(host, port, tls)

    def entry(account: Account) -> dict[str, str]:
        item = {"username": account.username, "password": account.password}
        if account.signing_key is not None:
            item["signing_key"] = account.signing_key
        if tls:
            item.update(ca_file=str(ca_file), cert_file=str(account.cert_file), key_file=str(account.key_file))
        return item

    document = {"federation": federation, "url": url, "coordinator": entry(accounts[COORDINATOR]),
                "devices": {d: entry(accounts[d]) for d in ids}}
    _write_secret(credentials, json.dumps(document, indent=2) + "\n")
    device_dir = out / "devices"
    if force and device_dir.exists():
        shutil.rmtree(device_dir)
    device_dir.mkdir(mode=0o700, exist_ok=True)
    device_files = [device_dir / f"{d}.json" for d in ids]
    for device, path in zip(ids, device_files, strict=True):
        own = {"federation": federation, "url": url, "devices": {device: entry(accounts[device])}}
        _write_secret(path, json.dumps(own, indent=2) + "\n")
    if user != current:
        for path in broker_files:
            os.chown(path, owner.pw_uid, owner.pw_gid)
    files = [config, passwords, acl, credentials, *device_files]
    if tls:
        files += sorted(tls_dir.rglob("*.crt")) + sorted(tls_dir.rglob("*.key"))
    return BrokerSetup(out, federation, url, config, passwords, acl, credentials, accounts, ca_file, files)


def describe(setup: BrokerSetup) -> str:
    """What was written and how to use it: the `broker-config` command's output."""
    coordinator = setup.accounts[COORDINATOR]
    device = next(a for name, a in setup.accounts.items() if name != COORDINATOR)
    tls_flags = ""
    if setup.ca_file is not None:
        tls_flags = (f" --ca-file {setup.ca_file} --cert-file {coordinator.cert_file} "
                     f"--key-file {coordinator.key_file}")
    device_tls = ""
    if setup.ca_file is not None:
        device_tls = f" --ca-file {setup.ca_file} --cert-file {device.cert_file} --key-file {device.key_file}"
    lines = [f"wrote {len(setup.accounts)} accounts (coordinator, {', '.join(list(setup.accounts)[1:])}) "
             f"for federation {setup.federation!r} to {setup.out}:"]
    lines += [f"  {path}" for path in setup.files]
    lines += [
        "",
        "start the broker:",
        f"  {setup.start_command}",
        "coordinator:",
        f"  edgepfl coordinator --broker {setup.url} --federation {setup.federation} "
        f"--credentials {setup.credentials}{tls_flags} ...",
        f"device {device.username} (copy {setup.out / 'devices' / (device.username + '.json')} to it, "
        f"never {setup.credentials.name}):",
        f"  edgepfl client --broker {setup.url} --federation {setup.federation} --client-id {device.username} "
        f"--credentials {device.username}.json{device_tls} ...",
    ]
    return "\n".join(lines)
