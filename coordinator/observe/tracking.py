"""Experiment trackers fed by the coordinator's events: TensorBoard and MLflow.

Each tracker subscribes to a coordinator's `EventBus`: at `RunStarted` it records the run's
settings (the RunConfig's flat settings, secrets left out) as hyperparameters/params; at every
`RoundEnded` the round's figures (`round_figures`) as scalars at step = round; `finish` then logs
what the run left in its folder: report.json and the released ONNX files (MLflow: artifacts;
TensorBoard: a text summary with their paths). The libraries are imported when a tracker is
made, so a missing one ends the command in one line naming the extra (`coordinator.extras`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..events import EventBus, RoundEnded, RunStarted
from ..run.folder import RunFolder
from ..run.report_files import read_report

MB = 1e6
PRIVATE_COUNTS = ("mb_up", "participants", "selected")
"""A round's figures a tracker does not get under DP."""
MLFLOW_PARAM_BATCH = 100
"""MLflow takes at most 100 params in one log_batch call."""
MLFLOW_PARAM_LENGTH = 500
"""The longest param value every MLflow tracking store accepts."""


def round_figures(record: Mapping[str, Any]) -> dict[str, float]:
    """A round's figures by name from its metrics.jsonl record: accuracy (mean personalized,
    when evaluated), global_accuracy (when the devices reported it), mb_up, mb_down,
    participants, selected, seconds and, under DP, epsilon. Under DP (the record has `privacy`)
    without mb_up, participants and selected: they count the round's sampled devices and uploads,
    which a tracker would publish beside the guarantee."""
    figures = {"mb_up": record["bytes_up"] / MB, "mb_down": record["bytes_down"] / MB,
               "participants": float(record["participants"]), "selected": float(record["selected"]),
               "seconds": float(record["seconds"])}
    if record.get("privacy") is not None:
        figures = {key: value for key, value in figures.items() if key not in PRIVATE_COUNTS}
    optional = {"accuracy": (record.get("personalized_accuracy") or {}).get("mean"),
                "global_accuracy": record.get("global_accuracy"),
                "epsilon": (record.get("privacy") or {}).get("epsilon")}
    figures.update({name: float(value) for name, value in optional.items() if value is not None})
    return figures


def plain_settings(settings: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """Settings as scalar values trackers take: None and tables (hyper, declared_task) as JSON text."""
    return {key: value if isinstance(value, (str, int, float, bool)) else json.dumps(value, sort_keys=True)
            for key, value in sorted(settings.items())}


def release_files(folder: RunFolder) -> list[Path]:
    """The ONNX files the run released (none when it released nothing)."""
    return sorted(folder.release_dir.glob("*.onnx")) if folder.release_dir.is_dir() else []


def report_summary(folder: RunFolder) -> str:
    """A few lines (Markdown) of the run's report, with the paths of report.json and the releases."""
    report = read_report(folder)
    if report is None:
        return f"no report: the run did not finish ({folder.report} missing)"
    final = (report.get("final") or {}).get("personalized_accuracy") or {}
    communication = report.get("communication") or {}
    lines = [f"- run `{report.get('run_id')}`: {report.get('algorithm')} on {report.get('dataset')}, "
             f"{report.get('rounds_completed')} rounds",
             f"- personalized accuracy (mean): {final.get('mean')}",
             f"- communication: {communication.get('bytes_up', 0) / MB:.2f} MB up, "
             f"{communication.get('bytes_down', 0) / MB:.2f} MB down",
             f"- wall time: {report.get('wall_seconds')} s"]
    if "privacy" in report:
        lines.append(f"- privacy: epsilon {report['privacy'].get('epsilon')} at delta {report['privacy'].get('delta')}")
    lines.append(f"- report: `{folder.report.resolve()}`")
    lines.extend(f"- released: `{path.resolve()}`" for path in release_files(folder))
    return "\n".join(lines)


class _EventTracker:
    """What both trackers share: the settings to record, and the events they follow."""

    def __init__(self, settings: Mapping[str, Any] | None) -> None:
        self.settings = plain_settings(settings or {})

    def attach(self, bus: EventBus) -> None:
        """Subscribe to the run's start and its rounds."""
        bus.subscribe(self.on_event, RunStarted, RoundEnded)

    def on_event(self, event: Any) -> None:
        """Record the settings at the start and each round's figures (other events are ignored)."""
        if isinstance(event, RunStarted):
            self.started(event.run_id)
        elif isinstance(event, RoundEnded):
            self.round(event.round, round_figures(event.record))

    def started(self, run_id: str) -> None:
        raise NotImplementedError

    def round(self, step: int, figures: Mapping[str, float]) -> None:
        raise NotImplementedError


class TensorBoardTracker(_EventTracker):
    """Writes TensorBoard event files under `log_dir`: scalars per round, the settings as hparams
    (and as a text table), the report's summary as text at the end."""

    def __init__(self, log_dir: str | Path, *, settings: Mapping[str, Any] | None = None) -> None:
        super().__init__(settings)
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def started(self, run_id: str) -> None:
        from torch.utils.tensorboard.summary import hparams

        file_writer = self.writer._get_file_writer()  # noqa: SLF001 (how add_hparams writes into the run's own file)
        for summary in hparams({"run_id": run_id, **self.settings}, {}):
            file_writer.add_summary(summary)
        table = "\n".join(["| setting | value |", "|---|---|",
                           *(f"| {key} | {value} |" for key, value in self.settings.items())])
        self.writer.add_text("settings", table, global_step=0)
        self.writer.flush()

    def round(self, step: int, figures: Mapping[str, float]) -> None:
        for name, value in figures.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def finish(self, folder: RunFolder, *, failed: bool = False) -> None:
        """The report's summary and paths as text (unless the run failed), then close the event file."""
        self.writer.add_text("report", "the run failed; no report" if failed else report_summary(folder))
        self.writer.close()


class MlflowTracker(_EventTracker):
    """Logs to MLflow at `uri` (a server, or a file store `file:` URI) in `experiment`, one MLflow
    run per edgepfl run (a resumed run goes on in the MLflow run its run_id is tagged in)."""

    RUN_ID_TAG = "edgepfl.run_id"

    def __init__(self, uri: str, experiment: str, *, settings: Mapping[str, Any] | None = None) -> None:
        super().__init__(settings)
        from mlflow.tracking import MlflowClient

        if uri.startswith("file:"):  # MLflow 3 keeps its file store behind this switch; a local default needs it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.uri, self.experiment = uri, experiment
        self.run_id: str | None = None

    def started(self, run_id: str) -> None:
        from mlflow.entities import Param

        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(self.experiment)
        earlier = self.client.search_runs([experiment_id], f"tags.`{self.RUN_ID_TAG}` = '{run_id}'", max_results=1)
        if earlier:
            self.run_id = earlier[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = self.client.create_run(experiment_id, tags={self.RUN_ID_TAG: run_id}, run_name=run_id).info.run_id
        params = [Param(key, str(value)[:MLFLOW_PARAM_LENGTH]) for key, value in self.settings.items()]
        for start in range(0, len(params), MLFLOW_PARAM_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + MLFLOW_PARAM_BATCH])

    def round(self, step: int, figures: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if self.run_id is None:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(name, value, now, step) for name, value in figures.items()])

    def finish(self, folder: RunFolder, *, failed: bool = False) -> None:
        """Log report.json and the released ONNX files as artifacts, and end the MLflow run
        (FAILED, without artifacts, when the run failed)."""
        if self.run_id is None:
            return
        if not failed and folder.report.is_file():
            self.client.log_artifact(self.run_id, str(folder.report))
            for path in release_files(folder):
                self.client.log_artifact(self.run_id, str(path), artifact_path="release")
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
