"""Settings declared once: typed sections whose fields say their help, flag and role.

A section is a dataclass; each field is made with `setting(...)`, which records its help text,
its key (the TOML key and, dashed, the command-line flag) when that differs from the field
name, whether it defines a run's results (and so its fingerprint), and which `edgepfl`
commands take it. The command line, the TOML reader, the flag table of docs/CONFIGURATION.md, WELCOME and the
run fingerprint are all derived from these declarations.

The two sections both sides of the wire need live here: `TrainSettings` (what the coordinator
announces in WELCOME and every device trains with) and `BrokerSettings` (how any process
connects). Only the standard library is imported, so building a parser stays instant.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .chunks import DEFAULT_CHUNK_SIZE, DEFAULT_UPLOAD_CHUNK_SIZE, check_chunk_size
from .config import ConfigError
from .protocol import COORDINATOR

RUN_COMMANDS = ("simulate", "coordinator")
"""The commands that run a federation (and so build a RunConfig)."""
DEVICE_COMMANDS = ("client", "lite-client")
ALL_COMMANDS = RUN_COMMANDS + DEVICE_COMMANDS

DEFINES = "always"
DEFINES_IF_SET = "if_set"
"""A setting added after runs were cached: it defines a run only when set to other than its
default, so runs made before it existed (or that keep the default) keep their fingerprint."""
OPTIMIZERS = ("paper", "sgd")
"""`optimizer`: each algorithm's own local optimizer, or one common SGD for every algorithm."""
DOWNLINK_CODECS = ("full", "fp16", "int8")
"""`downlink_codec`: TRAIN carries the whole shared state, or its change since the last TRAIN."""


@dataclass(frozen=True)
class SettingInfo:
    """What a field of a settings section declares besides its type and default."""

    help: str
    key: str | None = None
    """The TOML key (`_`) and flag (`--` + dashed) when not the field name."""
    defines: str | None = None
    """DEFINES, DEFINES_IF_SET or None: whether the setting defines the run's results."""
    commands: tuple[str, ...] | None = None
    """The commands that take it as a flag; None: the section's `commands`."""
    shown_default: str | None = None
    """How `--help` shows the default when the value itself would mislead (e.g. None)."""


def setting(default: Any, *, help: str, key: str | None = None, defines: str | None = None,
            commands: tuple[str, ...] | None = None, shown_default: str | None = None) -> Any:
    """A dataclass field with `default`, carrying its `SettingInfo` (see the module docstring)."""
    info = SettingInfo(help, key, defines, commands, shown_default)
    return dataclasses.field(default=default, metadata={"setting": info})


@dataclass(frozen=True)
class Setting:
    """One declared setting of a section, as the CLI, TOML and fingerprint see it."""

    field: dataclasses.Field
    info: SettingInfo
    commands: tuple[str, ...]

    @property
    def name(self) -> str:
        """The attribute of the section."""
        return self.field.name

    @property
    def key(self) -> str:
        """The flat key: TOML key, fingerprint key and (dashed) flag."""
        return self.info.key or self.field.name

    @property
    def flag(self) -> str:
        """The command-line flag."""
        return "--" + self.key.replace("_", "-")

    @property
    def shown_default(self) -> str:
        """The default as `--help` and docs/CONFIGURATION.md show it."""
        if self.info.shown_default is not None:
            return self.info.shown_default
        default = self.field.default
        if isinstance(default, bool):
            return "on" if default else "off"
        return "none" if default is None else str(default)


def settings_of(section: type) -> Iterator[Setting]:
    """The declared settings of a section class, in declaration order."""
    commands = getattr(section, "commands", RUN_COMMANDS)
    for f in dataclasses.fields(section):
        info = f.metadata.get("setting")
        if info is not None:
            yield Setting(f, info, info.commands if info.commands is not None else commands)


def check(ok: bool, key: str, what: str, value: Any) -> None:
    """Raise a ValueError naming `key` unless `ok` (readers of a file or flags turn it into a
    ConfigError, with where the value came from when that helps)."""
    if not ok:
        raise ValueError(f"{key} must be {what}, got {value!r}")


_MODEL_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?$")
"""A built-in name (`cnn8`, `auto`) or an import path `package.module:attribute`."""


def check_model_spec(spec: str) -> None:
    """Refuse a `model` that is neither a name nor `package.module:attribute` (syntax only: whether
    it resolves is `edge_sdk.models.resolve_factory`'s business)."""
    dotted_without_attribute = "." in spec and ":" not in spec
    check(isinstance(spec, str) and bool(_MODEL_SPEC.match(spec)) and not dotted_without_attribute, "model",
          "auto, a built-in model name or an import path package.module:factory", spec)


@dataclass(frozen=True)
class TrainSettings:
    """The run's training settings: the `[training]` section, announced by the coordinator in
    WELCOME and used as is by every trainer device."""

    commands: ClassVar[tuple[str, ...]] = RUN_COMMANDS

    model: str = setting("auto", defines=DEFINES,
                         help="auto (the task's default), a built-in name (cnn8, cnn8_wide, cnn28, cnn32, resnet18, "
                              "mobilenet_v3_small) or an import path package.module:factory")
    rounds: int = setting(5, help="federated rounds")
    local_epochs: int = setting(2, defines=DEFINES, help="local epochs per round")
    batch_size: int = setting(32, defines=DEFINES, help="local batch size")
    lr: float = setting(0.05, defines=DEFINES,
                        help="local learning rate (SGD, momentum 0.9, unless the algorithm says otherwise; every "
                                 "local phase's with optimizer=sgd)")
    seed: int = setting(0, defines=DEFINES, commands=ALL_COMMANDS,
                        help="the run's seed (selection, partition, initialization)")
    upload_codec: str = setting("fp32", defines=DEFINES,
                                help="fp32 | fp16 | int8 | q4 | q2 | topk: devices send their change from the "
                                     "broadcast in full, half or a quarter of the bytes, stochastically quantized to 4 "
                                     "or 2 bits per value, or only its largest entries (topk_fraction, with error "
                                     "feedback)")
    downlink_codec: str = setting("full", defines=DEFINES_IF_SET,
                                  help="full | fp16 | int8: every TRAIN carries the whole shared state in its dtype, "
                                       "or its change since the previous TRAIN in half or a quarter of the bytes "
                                       "(a device lacking that state asks for it in full); sync rounds only")
    topk_fraction: float = setting(0.01, defines=DEFINES_IF_SET,
                                   help="upload_codec topk: the fraction of each changed array's entries a device "
                                        "sends (at most ceil(fraction x size)); announced in WELCOME")
    grad_clip_norm: float = setting(0.0, defines=DEFINES_IF_SET,
                                    help="devices scale each local step's gradients to at most this L2 norm "
                                         "(0: off); announced in WELCOME, so every trainer clips alike")
    optimizer: str = setting("paper", defines=DEFINES_IF_SET,
                             help="paper | sgd: every local training phase uses its algorithm's own optimizer (as its "
                                  "paper prescribes), or, for every algorithm alike, SGD with --lr, --sgd-momentum and "
                                  "--sgd-weight-decay (a fair comparison of methods)")
    sgd_momentum: float = setting(0.9, defines=DEFINES_IF_SET, help="momentum of the common SGD (optimizer=sgd)")
    sgd_weight_decay: float = setting(0.0, defines=DEFINES_IF_SET,
                                      help="weight decay of the common SGD (optimizer=sgd)")
    validation_fraction: float = setting(0.0, defines=DEFINES_IF_SET,
                                         help="each device holds out this seeded share of its training data, trains "
                                              "on the rest and is evaluated on it instead of its test split (0: off; "
                                              "to choose hyperparameters without looking at test data)")

    def __post_init__(self) -> None:
        check_model_spec(self.model)
        check(self.rounds >= 1, "rounds", "at least 1", self.rounds)
        check(self.local_epochs >= 1, "local_epochs", "at least 1", self.local_epochs)
        check(self.batch_size >= 1, "batch_size", "at least 1", self.batch_size)
        check(self.lr > 0, "lr", "positive", self.lr)
        check(self.seed >= 0, "seed", "zero or more", self.seed)
        check(math.isfinite(self.grad_clip_norm) and self.grad_clip_norm >= 0, "grad_clip_norm",
              "zero (off) or a positive finite norm", self.grad_clip_norm)
        check(self.optimizer in OPTIMIZERS, "optimizer", "paper or sgd", self.optimizer)
        check(math.isfinite(self.sgd_momentum) and 0 <= self.sgd_momentum < 1, "sgd_momentum", "in [0, 1)",
              self.sgd_momentum)
        check(math.isfinite(self.sgd_weight_decay) and self.sgd_weight_decay >= 0, "sgd_weight_decay",
              "zero or a positive finite number", self.sgd_weight_decay)
        if self.optimizer == "paper":
            for key in ("sgd_momentum", "sgd_weight_decay"):
                default = TrainSettings.__dataclass_fields__[key].default
                check(getattr(self, key) == default, key, f"{default} unless optimizer is sgd (the algorithms' own "
                      f"optimizers take no run-level {key})", getattr(self, key))
        check(math.isfinite(self.topk_fraction) and 0 < self.topk_fraction <= 1, "topk_fraction", "in (0, 1]",
              self.topk_fraction)
        topk_default = TrainSettings.__dataclass_fields__["topk_fraction"].default
        check(self.upload_codec == "topk" or self.topk_fraction == topk_default, "topk_fraction",
              f"{topk_default} unless upload_codec is topk", self.topk_fraction)
        check(self.downlink_codec in DOWNLINK_CODECS, "downlink_codec", "full, fp16 or int8", self.downlink_codec)
        check(0 <= self.validation_fraction < 1, "validation_fraction", "in [0, 1)", self.validation_fraction)


MQTT_PROTOCOLS = ("auto", "5", "3.1.1")
DEFAULT_BROKER = "mqtt://127.0.0.1:1883"
PASSWORD_VARIABLE = "EDGEPFL_PASSWORD"
"""The environment variable a password is read from when neither --password nor --password-file
is given (out of `ps` and shell history, unlike --password)."""
CONNECTING_COMMANDS = ("coordinator", *DEVICE_COMMANDS)
"""The commands that connect to a broker someone else starts (simulate's is up before it)."""


@dataclass(frozen=True)
class BrokerSettings:
    """How a process reaches the federation: the `[broker]` section, the same flags on every command."""

    commands: ClassVar[tuple[str, ...]] = ALL_COMMANDS

    broker: str | None = setting(None, help="mqtt://host:port or mqtts://host:port of the broker",
                                 shown_default=f"simulate: an embedded amqtt broker; others: {DEFAULT_BROKER}")
    federation: str = setting("default", help="federation name (topic namespace)")
    mqtt_protocol: str = setting("auto", help="MQTT version: auto | 5 | 3.1.1")
    username: str | None = setting(None, help="MQTT username")
    password: str | None = setting(None, help=f"MQTT password (visible in `ps`: prefer --password-file or "
                                              f"{PASSWORD_VARIABLE})", shown_default=f"${PASSWORD_VARIABLE}")
    password_file: str | None = setting(None, help="file whose first line is the MQTT password")
    ca_file: str | None = setting(None, help="CA certificate for TLS (mqtts://)")
    cert_file: str | None = setting(None, help="client certificate for mutual TLS")
    key_file: str | None = setting(None, help="client key for mutual TLS")
    credentials: str | None = setting(None, help="credentials.json from `edgepfl broker-config` (coordinator and "
                                                 "device accounts)")
    chunk_size: int = setting(DEFAULT_CHUNK_SIZE, commands=RUN_COMMANDS,
                              help="largest message the coordinator publishes whole, in bytes (16 KiB to 64 MiB, "
                                   "e.g. 131072 for cloud brokers); larger ones are chunked")
    upload_chunk_size: int = setting(DEFAULT_UPLOAD_CHUNK_SIZE, commands=("simulate",),
                                     help="the same for the simulated devices' uploads (an update is one message)")
    flow_control_bytes: int = setting(1 << 20, commands=RUN_COMMANDS,
                                      help="the coordinator stops reading from the broker while it holds this many "
                                           "bytes of received messages (0: off)")
    connect_timeout: float = setting(60.0, commands=CONNECTING_COMMANDS,
                                     help="seconds to keep retrying the first connection while the broker is not "
                                          "up yet, with backoff (0: one try); a refused account is not retried")

    def __post_init__(self) -> None:
        check(self.mqtt_protocol in MQTT_PROTOCOLS, "mqtt_protocol", "auto, 5 or 3.1.1", self.mqtt_protocol)
        check(self.flow_control_bytes >= 0, "flow_control_bytes", "zero (off) or more", self.flow_control_bytes)
        check(self.connect_timeout >= 0, "connect_timeout", "zero (one try) or more seconds", self.connect_timeout)
        if self.password is not None and self.password_file is not None:
            raise ConfigError("give either password or password_file, not both")
        try:
            check_chunk_size(self.chunk_size)
            check_chunk_size(self.upload_chunk_size, "upload_chunk_size")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def mqtt_settings(self, account: str, url: str | None = None):
        """How `account` ("coordinator" or a device id) connects to `url` (default: `broker`, else
        the local default): an explicit username with its password (`password`, else
        `password_file`, else $EDGEPFL_PASSWORD), else `account` in `credentials`."""
        from .signing import SigningKeyError, device_key
        from .transport import MqttSettings

        username, password = self.username, self.given_password()
        if username is None and self.credentials:
            username, password = load_credentials(self.credentials, account)
        try:
            signing_key = device_key(self.credentials, account) if self.credentials and account != COORDINATOR else None
        except SigningKeyError as exc:
            raise ConfigError(str(exc)) from None
        try:
            return MqttSettings(url=url or self.broker or DEFAULT_BROKER, username=username, password=password,
                                ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file,
                                protocol=self.mqtt_protocol, retry_first_connect=self.connect_timeout,
                                give_up_when_denied=True, signing_key=signing_key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def given_password(self) -> str | None:
        """The password: `password`, else the first line of `password_file`, else $EDGEPFL_PASSWORD."""
        if self.password is not None:
            return self.password
        if self.password_file is not None:
            try:
                lines = Path(self.password_file).read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"password_file {self.password_file}: {exc.strerror}") from None
            return lines[0] if lines else ""
        return os.environ.get(PASSWORD_VARIABLE)


def load_credentials(path: str, account: str) -> tuple[str, str]:
    """(username, password) of `account` ("coordinator" or a device id) in a credentials.json
    as written by `edgepfl broker-config`."""
    try:
        document = json.loads(Path(path).read_text())
        entry = document["coordinator"] if account == "coordinator" else document["devices"][account]
        return entry["username"], entry["password"]
    except FileNotFoundError:
        raise ConfigError(f"credentials file {path} does not exist") from None
    except (KeyError, TypeError, json.JSONDecodeError):
        raise ConfigError(f"credentials file {path} has no entry for {account!r}") from None
