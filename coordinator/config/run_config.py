"""The run configuration: settings sections, filled from defaults, a TOML file and the command line.

A RunConfig is made of sections (`run`, `training`, `round`, `aggregation`, `broker`,
`simulation`, `observe`), each a dataclass whose fields declare their key, help and role (see
`edge_sdk.settings`). TOML takes the keys either flat (`dataset = "fmnist"`, `local-epochs = 3`:
the same keys as the command-line flags) or in section tables (`[training]`, `[round]`, ...),
plus one `[algorithm.<id>]` table per algorithm for its hyperparameters (the algorithm itself is
then chosen with `id` in the `[algorithm]` table) and an optional `[task]` table that declares
the task of a user's data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from edge_sdk.algorithms.hyper import hyper_class
from edge_sdk.config import ConfigError, coerce, load_toml
from edge_sdk.privacy import PrivacySettings
from edge_sdk.privacy.secagg_settings import SecAggSettings
from edge_sdk.settings import DEFINES, DEFINES_IF_SET, BrokerSettings, Setting, TrainSettings, settings_of

from ..aggregation.robust import AggregationSettings
from ..observe.settings import ObserveSettings
from .sections import RoundSettings, RunSettings, SimulationSettings

SECTIONS: dict[str, type] = {
    "run": RunSettings,
    "training": TrainSettings,
    "round": RoundSettings,
    "aggregation": AggregationSettings,
    "privacy": PrivacySettings,
    "secagg": SecAggSettings,
    "broker": BrokerSettings,
    "simulation": SimulationSettings,
    "observe": ObserveSettings,
}
"""The sections of a RunConfig, by attribute (and TOML table) name."""


def all_settings() -> Iterator[tuple[str, Setting]]:
    """Every declared setting of a run, with the name of its section."""
    for section, cls in SECTIONS.items():
        for item in settings_of(cls):
            yield section, item


SECRETS = ("password", "http_token")
"""Settings never written into a run's files (checkpoint, benchmark configs)."""

KEYS: dict[str, tuple[str, Setting]] = {item.key: (section, item) for section, item in all_settings()}
"""Flat key -> (section, setting): keys are unique across sections."""


@dataclass
class RunConfig:
    """Everything that defines a federated run, plus how it is executed, in sections."""

    run: RunSettings = field(default_factory=RunSettings)
    training: TrainSettings = field(default_factory=TrainSettings)
    round: RoundSettings = field(default_factory=RoundSettings)
    aggregation: AggregationSettings = field(default_factory=AggregationSettings)
    privacy: PrivacySettings = field(default_factory=PrivacySettings)
    secagg: SecAggSettings = field(default_factory=SecAggSettings)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    simulation: SimulationSettings = field(default_factory=SimulationSettings)
    observe: ObserveSettings = field(default_factory=ObserveSettings)
    hyper: dict[str, Any] = field(default_factory=dict)
    """The algorithm's hyperparameters (`[algorithm.<id>]` and `--set`)."""
    declared_task: dict[str, Any] | None = None
    """The `[task]` table: kind, input_shape, class_names, mean, std of a user's data."""
    _task: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from edge_sdk.algorithms import ALGORITHM_IDS
        from edge_sdk.attacks import ATTACKS
        from edge_sdk.codecs import CODECS
        from edge_sdk.data import BUILTIN_TASKS, PARTITIONS

        from ..hosting.availability import parse_availability
        from ..hosting.device_ranges import parse_shards

        run, simulation = self.run, self.simulation
        checks = [
            (run.algorithm in ALGORITHM_IDS, "algorithm", run.algorithm, f"one of {', '.join(ALGORITHM_IDS)}"),
            (run.dataset is None or run.dataset in BUILTIN_TASKS, "dataset", run.dataset,
             f"one of {', '.join(BUILTIN_TASKS)}"),
            (run.partition in PARTITIONS, "partition", run.partition, f"one of {', '.join(PARTITIONS)}"),
            (self.training.upload_codec in CODECS, "upload_codec", self.training.upload_codec,
             f"one of {', '.join(CODECS)}"),
            (simulation.attack in (*ATTACKS, "mixed"), "attack", simulation.attack,
             f"one of {', '.join(ATTACKS)} or mixed"),
            (self.round.holdout_clients < run.clients, "holdout_clients", self.round.holdout_clients,
             "zero or more and fewer than clients"),
            (simulation.adversaries <= run.clients, "adversaries", simulation.adversaries, "between 0 and clients"),
        ]
        for ok, key, value, what in checks:
            if not ok:
                raise ConfigError(f"{key} must be {what}, got {value!r}")
        if self.privacy.enabled:
            self.privacy.delta_for(run.clients)  # refused by its key when not below 1 / devices
        parse_shards(simulation.local_aggregators, self.round.shards, "local_aggregators")  # refused by its key
        parse_availability(simulation.availability, run.clients)  # so is a bad trace file, by its line
        if self.lite_devices >= run.clients:
            raise ConfigError(f"lite_fraction {simulation.lite_fraction} leaves no trainer device among {run.clients}")
        trainers = run.clients - self.lite_devices
        if self.round.min_clients > trainers:
            raise ConfigError(f"min_clients must be at most the {trainers} trainer devices ({run.clients} clients, "
                              f"{self.lite_devices} weak ones by lite_fraction), got {self.round.min_clients}")
        if self.lite_devices and not run.release and not _releases(run.algorithm):
            raise ConfigError(f"lite_fraction {simulation.lite_fraction} with algorithm {run.algorithm}, which "
                              "releases no representation: the weak devices would have nothing to personalize; "
                              "set release (--release) or lite_fraction 0")

    @classmethod
    def of(cls, *, hyper: Mapping[str, Any] | None = None, declared_task: Mapping[str, Any] | None = None,
           **values: Any) -> RunConfig:
        """A RunConfig from flat keys (`RunConfig.of(algorithm="fedrep", rounds=3)`); unknown keys are named."""
        return cls(**_sections(values, where="RunConfig.of"), hyper=dict(hyper or {}),
                   declared_task=dict(declared_task) if declared_task is not None else None)

    def replace(self, **values: Any) -> RunConfig:
        """A copy with the flat keys in `values` changed (`config.replace(out="runs/b", rounds=9)`);
        naming one of `dataset` and `data` drops the other."""
        for named, other in (("data", "dataset"), ("dataset", "data")):
            if named in values and other not in values:
                values = {**values, other: None}
        changed = _sections(values, where="RunConfig.replace", base=self)
        return dataclasses.replace(self, **changed)

    def to_flat(self) -> dict[str, Any]:
        """Every setting by its flat key but the secrets (`SECRETS`), plus hyper (and the declared
        task when set): what a checkpoint records and what `RunConfig.of` and a flat TOML file
        take back."""
        flat = {item.key: getattr(getattr(self, section), item.name) for section, item in all_settings()
                if item.key not in SECRETS}
        flat["hyper"] = dict(self.hyper)
        if self.declared_task is not None:
            flat["declared_task"] = dict(self.declared_task)
        return flat

    def task(self):
        """The run's task: the built-in dataset's, or inferred from the `data` file, with what the
        `[task]` table declares; resolved once (a data file is read to infer it)."""
        if self._task is None:
            from edge_sdk.data import resolve_task

            try:
                self._task = resolve_task(self.run.dataset, self.run.data, self.run.data_dir, self.declared_task)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        return self._task

    @property
    def model_name(self) -> str:
        """The model spec the run trains: `training.model`, with `auto` resolved for the task."""
        from edge_sdk.models import default_model_for

        model = self.training.model
        return default_model_for(self.task()) if model == "auto" else model

    def welcome_settings(self) -> dict[str, Any]:
        """The training section as devices receive it in WELCOME: the model resolved, and the
        settings added later (`DEFINES_IF_SET`: `grad_clip_norm`, `optimizer`, ...) only when not at
        their default (devices older than them accept the message unchanged)."""
        settings = dataclasses.asdict(dataclasses.replace(self.training, model=self.model_name))
        for item in settings_of(TrainSettings):
            if item.info.defines == DEFINES_IF_SET and settings[item.name] == item.field.default:
                del settings[item.name]
        return settings

    def attack_of(self, index: int) -> str | None:
        """The attack simulated device `index` runs: the first `adversaries` devices are adversaries;
        `mixed` gives them sign_flip, noise and nan in turn."""
        from edge_sdk.attacks import ATTACKS

        if index >= self.simulation.adversaries:
            return None
        attack = self.simulation.attack
        return ATTACKS[index % len(ATTACKS)] if attack == "mixed" else attack

    @property
    def lite_devices(self) -> int:
        """How many simulated devices are weak ones: the last ones by index."""
        return int(round(self.simulation.lite_fraction * self.run.clients))

    @property
    def local_shards(self) -> tuple[int, ...]:
        """The shards whose aggregators `edgepfl simulate` hosts (`local_aggregators`, of `shards`)."""
        from ..hosting.device_ranges import parse_shards

        return parse_shards(self.simulation.local_aggregators, self.round.shards, "local_aggregators")

    @property
    def worker_count(self) -> int:
        return self.simulation.workers or os.cpu_count() or 1

    def coordinator_transport(self, url: str):
        """The coordinator's connection (not yet connected), with flow control: its network
        thread stops reading while the coordinator holds more than `flow_control_bytes` of
        received messages, so a round's backlog of uploads waits at the broker, not here."""
        from edge_sdk.transport import MqttTransport

        return MqttTransport(f"{self.broker.federation}.coordinator", self.mqtt_settings(url),
                             flow_control_bytes=self.broker.flow_control_bytes)

    def coordinator_channel(self, transport):
        """The coordinator's channel: room to reassemble an upload from every device at once
        (chunked uploads of a whole fleet interleave at the broker); with `credentials`, every
        upload must carry its device's signature (the keys enrolled there)."""
        from edge_sdk.channel import Channel
        from edge_sdk.protocol import Topics
        from edge_sdk.signing import SigningKeyError, fleet_verifier

        try:
            verifier = fleet_verifier(self.broker.credentials) if self.broker.credentials else None
        except SigningKeyError as exc:
            raise ConfigError(str(exc)) from None
        return Channel(transport, Topics(self.broker.federation), chunk_size=self.broker.chunk_size,
                       max_pending_blobs=2 * self.run.clients + 64, verifier=verifier)

    def mqtt_settings(self, url: str, account: str = "coordinator"):
        """How `account` connects to `url`: explicit username/password, else its entry in `credentials`."""
        return self.broker.mqtt_settings(account, url)

    def defining(self) -> dict[str, Any]:
        """The settings that define the run's results, by flat key, as plain JSON values: what
        the fingerprint hashes and what the coordinator announces while it registers devices
        (so `edgepfl workers` can check that it hosts devices of this very run).

        The settings declared with `defines` enter by their flat key (`rounds` is left out so a
        finished run can be extended, unless the algorithm's schedule spans the round budget, its
        Hyper's `spans_rounds`; paths, timeouts and how the run is executed are left out); those
        declared `DEFINES_IF_SET` only when they differ from their default, so runs made before
        they existed keep their fingerprint.
        """
        defining: dict[str, Any] = {}
        for section, item in all_settings():
            value = getattr(getattr(self, section), item.name)
            if_set = item.info.defines == DEFINES_IF_SET and value != item.field.default
            if item.info.defines == DEFINES or if_set:
                defining[item.key] = value
        defining["hyper"] = self.hyper
        if getattr(hyper_class(self.run.algorithm), "spans_rounds", False):
            defining["rounds"] = self.training.rounds
        defining["model"] = self.model_name
        if self.declared_task is not None:
            defining["declared_task"] = self.declared_task
        return json.loads(json.dumps(defining, default=str))

    def fingerprint(self) -> str:
        """A hash of the settings that define the run's results (`defining`); a resume requires the same one."""
        return hashlib.sha256(json.dumps(self.defining(), sort_keys=True).encode()).hexdigest()[:16]


def _releases(algorithm: str) -> bool:
    """Whether `algorithm` releases a representation without `release` (imported only when asked)."""
    from ..algorithms import load

    return load(algorithm).releases_representation


def _sections(values: Mapping[str, Any], *, where: str, base: RunConfig | None = None) -> dict[str, Any]:
    """The sections that `values` (flat keys) change, built on `base` (or the defaults); unknown
    keys and bad values are named."""
    routed: dict[str, dict[str, Any]] = {}
    for raw_key, value in values.items():
        key = raw_key.replace("-", "_")
        if key not in KEYS:
            raise ConfigError(f"unknown key {raw_key!r} in {where}; known keys: {', '.join(sorted(KEYS))}")
        routed.setdefault(KEYS[key][0], {})[key] = value
    return {section: _section(section, changes, where, base) for section, changes in routed.items()}


def _table_keys(section: str, table: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The keys of a `[section]` table, checked to belong to that section."""
    for raw_key in table:
        key = raw_key.replace("-", "_")
        if key not in KEYS or KEYS[key][0] != section:
            home = f"; it belongs to [{KEYS[key][0]}]" if key in KEYS else ""
            known = ", ".join(item.key for item in settings_of(SECTIONS[section]))
            raise ConfigError(f"unknown key {raw_key!r} in [{section}] of {where}{home}; known keys: {known}")
    return dict(table)


def _section(section: str, changes: Mapping[str, Any], where: str, base: RunConfig | None):
    """Section `section` of `base` (or its defaults) with `changes` (flat keys) coerced and applied."""
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    current = dataclasses.asdict(getattr(base, section)) if base is not None else {}
    for key, value in changes.items():
        name = KEYS[key][1].name
        current[name] = coerce(key, value, hints[name])
    try:
        return cls(**current)
    except ConfigError:
        raise
    except ValueError as exc:  # the section's own check, which names the key
        raise ConfigError(str(exc)) from None
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def build_config(
    file: str | None, overrides: Mapping[str, Any], assignments: Mapping[str, str]
) -> RunConfig:
    """Defaults <- TOML file <- command-line flags (non-None) <- `--set` hyperparameters.

    In TOML the algorithm is either `algorithm = "<id>"` or, next to hyperparameter tables,
    `[algorithm]` with `id = "<id>"` and one `[algorithm.<id>]` table per algorithm.
    """
    flat: dict[str, Any] = {}
    hyper_tables: dict[str, dict[str, Any]] = {}
    declared_task = None
    if file:
        document = load_toml(file)
        section = document.pop("algorithm", None)
        if isinstance(section, dict):
            if "id" in section:
                flat["algorithm"] = section.pop("id")
            if not all(isinstance(t, dict) for t in section.values()):
                raise ConfigError(f"{file}: [algorithm] takes `id` and one [algorithm.<id>] table per algorithm")
            hyper_tables = section
        elif section is not None:
            flat["algorithm"] = section
        declared_task = document.pop("task", None)
        if declared_task is not None and not isinstance(declared_task, dict):
            raise ConfigError(f"{file}: task must be a [task] table (kind, input_shape, class_names, mean, std)")
        for key, value in document.items():
            if key in SECTIONS and isinstance(value, dict):
                flat.update(_table_keys(key, value, file))
            else:
                flat[key] = value
    flat.update({k: v for k, v in overrides.items() if v is not None})
    config = RunConfig(**_sections(flat, where=file or "command line"), declared_task=declared_task)
    config.hyper = {**hyper_tables.get(config.run.algorithm, {}), **assignments}
    return config
