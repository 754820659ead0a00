"""The run configuration: one dataclass, filled from defaults, a TOML file and the command line.

TOML files use the same keys as the command-line flags (`local_epochs` or `local-epochs`), plus
one `[algorithm.<id>]` table per algorithm for its hyperparameters (the algorithm itself is then
chosen with `id` in the `[algorithm]` table).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from edge_sdk.chunks import DEFAULT_CHUNK_SIZE, DEFAULT_UPLOAD_CHUNK_SIZE, check_chunk_size
from edge_sdk.config import ConfigError, from_mapping, load_toml
from edge_sdk.data import DATASETS, PARTITIONS
from edge_sdk.models import MODEL_NAMES, default_model_for
from edge_sdk.attacks import ATTACKS
from edge_sdk.codecs import CODECS
from edge_sdk.channel import Channel
from edge_sdk.protocol import Topics
from edge_sdk.transport import MqttSettings, MqttTransport

from .robust import AggregationSettings


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


@dataclass
class RunConfig:
    """Everything that defines a federated run, plus how it is executed."""

    algorithm: str = "fedavg"
    dataset: str = "digits"
    data_dir: str | None = None
    partition: str = "iid"
    alpha: float = 0.5
    classes_per_client: int = 2
    clients: int = 10
    fraction: float = 1.0
    rounds: int = 5
    local_epochs: int = 2
    batch_size: int = 32
    lr: float = 0.05
    model: str = "auto"
    seed: int = 0
    eval_every: int = 1
    federation: str = "default"
    round_timeout: float = 120.0
    min_clients: int = 1
    holdout_clients: int = 0
    quorum_grace: float = 10.0
    registration_timeout: float = 300.0
    max_examples: int = 1_000_000
    max_update_norm: float = 0.0
    aggregation: str = "mean"
    trim_fraction: float = 0.2
    clip_norm: float = 0.0
    grad_clip_norm: float = 0.0
    aggregation_dtype: str = "float32"
    release: bool = False
    lite_fraction: float = 0.0
    head: str = "svm"
    adversaries: int = 0
    attack: str = "sign_flip"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    upload_chunk_size: int = DEFAULT_UPLOAD_CHUNK_SIZE
    flow_control_bytes: int = 1 << 20
    out: str = "runs/latest"
    broker: str | None = None
    workers: int = 0
    device: str = "auto"
    amp: bool = False
    upload_codec: str = "fp32"
    mqtt_protocol: str = "auto"
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    credentials: str | None = None
    hyper: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from edge_sdk.algorithms import ALGORITHM_IDS

        checks = [
            (self.algorithm in ALGORITHM_IDS, "algorithm", f"one of {', '.join(ALGORITHM_IDS)}"),
            (self.dataset in DATASETS, "dataset", f"one of {', '.join(DATASETS)}"),
            (self.partition in PARTITIONS, "partition", f"one of {', '.join(PARTITIONS)}"),
            (self.model == "auto" or self.model in MODEL_NAMES, "model", f"auto or one of {', '.join(MODEL_NAMES)}"),
            (self.alpha > 0, "alpha", "positive"),
            (self.seed >= 0, "seed", "zero or more"),
            (self.clients >= 1, "clients", "at least 1"),
            (0 < self.fraction <= 1, "fraction", "in (0, 1]"),
            (self.rounds >= 1, "rounds", "at least 1"),
            (self.local_epochs >= 1, "local_epochs", "at least 1"),
            (self.batch_size >= 1, "batch_size", "at least 1"),
            (self.lr > 0, "lr", "positive"),
            (self.eval_every >= 1, "eval_every", "at least 1"),
            (self.round_timeout > 0, "round_timeout", "positive"),
            (self.min_clients >= 1, "min_clients", "at least 1"),
            (0 <= self.holdout_clients < self.clients, "holdout_clients", "zero or more and fewer than clients"),
            (self.quorum_grace >= 0, "quorum_grace", "zero or more"),
            (self.max_examples >= 1, "max_examples", "at least 1"),
            (self.max_update_norm >= 0, "max_update_norm", "zero (off) or positive"),
            (math.isfinite(self.grad_clip_norm) and self.grad_clip_norm >= 0, "grad_clip_norm",
             "zero (off) or a positive finite norm"),
            (0 <= self.adversaries <= self.clients, "adversaries", "between 0 and clients"),
            (0 <= self.lite_fraction < 1, "lite_fraction", "in [0, 1)"),
            (self.head in ("svm", "lr", "mlp", "ncm"), "head", "svm, lr, mlp or ncm"),
            (self.upload_codec in CODECS, "upload_codec", f"one of {', '.join(CODECS)}"),
            (self.attack in (*ATTACKS, "mixed"), "attack", f"one of {', '.join(ATTACKS)} or mixed"),
            (self.mqtt_protocol in ("auto", "5", "3.1.1"), "mqtt_protocol", "auto, 5 or 3.1.1"),
            (self.workers >= 0, "workers", "zero (one per core) or more"),
            (self.flow_control_bytes >= 0, "flow_control_bytes", "zero (off) or more"),
        ]
        for ok, key, what in checks:
            if not ok:
                raise ConfigError(f"{key} must be {what}, got {getattr(self, key)!r}")
        if self.lite_devices >= self.clients:
            raise ConfigError(f"lite_fraction {self.lite_fraction} leaves no trainer device among {self.clients}")
        try:
            check_chunk_size(self.chunk_size)
            check_chunk_size(self.upload_chunk_size, "upload_chunk_size")
            self.aggregation_settings
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def model_name(self) -> str:
        return default_model_for(DATASETS[self.dataset].image_size) if self.model == "auto" else self.model

    @property
    def aggregation_settings(self) -> AggregationSettings:
        return AggregationSettings(self.aggregation, self.trim_fraction, self.clip_norm, self.aggregation_dtype)

    def attack_of(self, index: int) -> str | None:
        """The attack simulated device `index` runs: the first `adversaries` devices are adversaries;
        `mixed` gives them sign_flip, noise and nan in turn."""
        if index >= self.adversaries:
            return None
        return ATTACKS[index % len(ATTACKS)] if self.attack == "mixed" else self.attack

    @property
    def lite_devices(self) -> int:
        """How many simulated devices are weak ones: the last ones by index."""
        return int(round(self.lite_fraction * self.clients))

    @property
    def worker_count(self) -> int:
        return self.workers or os.cpu_count() or 1

    def coordinator_transport(self, url: str) -> MqttTransport:
        """The coordinator's connection (not yet connected), with flow control: its network
        thread stops reading while the coordinator holds more than `flow_control_bytes` of
        received messages, so a round's backlog of uploads waits at the broker, not here."""
        return MqttTransport(f"{self.federation}.coordinator", self.mqtt_settings(url),
                             flow_control_bytes=self.flow_control_bytes)

    def coordinator_channel(self, transport) -> Channel:
        """The coordinator's channel: room to reassemble an upload from every device at once
        (chunked uploads of a whole fleet interleave at the broker)."""
        return Channel(transport, Topics(self.federation), chunk_size=self.chunk_size,
                       max_pending_blobs=2 * self.clients + 64)

    def mqtt_settings(self, url: str, account: str = "coordinator") -> MqttSettings:
        """How this side connects: explicit username/password, else `account` in `credentials`."""
        username, password = self.username, self.password
        if username is None and self.credentials:
            username, password = load_credentials(self.credentials, account)
        return MqttSettings(url=url, username=username, password=password, ca_file=self.ca_file,
                            cert_file=self.cert_file, key_file=self.key_file, protocol=self.mqtt_protocol)

    def fingerprint(self) -> str:
        """A hash of the settings that define the run's results; a resume requires the same one.

        `rounds` is left out so a finished run can be extended; so are paths, timeouts and how
        the run is executed.
        """
        defining = {k: v for k, v in asdict(self).items() if k in _DEFINING or (k in _DEFINING_IF_SET and v)}
        defining["model"] = self.model_name
        return hashlib.sha256(json.dumps(defining, sort_keys=True, default=str).encode()).hexdigest()[:16]


_DEFINING = {
    "algorithm", "dataset", "partition", "alpha", "classes_per_client", "clients", "fraction",
    "local_epochs", "batch_size", "lr", "model", "seed", "hyper", "holdout_clients",
    "aggregation", "trim_fraction", "clip_norm", "adversaries", "attack", "lite_fraction", "head", "upload_codec",
}
_DEFINING_IF_SET = {"grad_clip_norm"}
"""Settings added after runs were cached: they define a run only when set, so runs made before keep their fingerprint."""


def build_config(
    file: str | None, overrides: Mapping[str, Any], assignments: Mapping[str, str]
) -> RunConfig:
    """Defaults <- TOML file <- command-line flags (non-None) <- `--set` hyperparameters.

    In TOML the algorithm is either `algorithm = "<id>"` or, next to hyperparameter tables,
    `[algorithm]` with `id = "<id>"` and one `[algorithm.<id>]` table per algorithm.
    """
    values: dict[str, Any] = {}
    hyper_tables: dict[str, dict[str, Any]] = {}
    if file:
        document = load_toml(file)
        section = document.pop("algorithm", None)
        if isinstance(section, dict):
            if "id" in section:
                values["algorithm"] = section.pop("id")
            if not all(isinstance(t, dict) for t in section.values()):
                raise ConfigError(f"{file}: [algorithm] takes `id` and one [algorithm.<id>] table per algorithm")
            hyper_tables = section
        elif section is not None:
            values["algorithm"] = section
        values.update(document)
    values.update({k: v for k, v in overrides.items() if v is not None})
    config = from_mapping(RunConfig, values, where=file or "command line")
    config.hyper = {**hyper_tables.get(config.algorithm, {}), **assignments}
    return config
