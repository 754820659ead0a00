"""A short real run (loopback broker: 3 digits devices, 2 rounds) tracked with TensorBoard and
MLflow through `observing`, as the coordinator command wires it, read back with each tool's own
reader."""

from __future__ import annotations

import json

import pytest



def _tracked_run(federation, **settings):
    from coordinator.observe.session import observing

    config = federation.config(**settings)
    coordinator = federation.coordinator(config)
    for index in range(3):
        federation.start_device(index, 3)
    with observing(config) as observation:
        coordinator.subscribe(observation.on_event)
        report = coordinator.run()
    return config, report


def test_under_dp_a_tracker_gets_no_round_s_counts_of_devices_or_uploads():
    from coordinator.observe.tracking import round_figures

    record = {"round": 1, "bytes_up": 3_000_000, "bytes_down": 1_000_000, "participants": 3, "selected": 4,
              "seconds": 2.0, "personalized_accuracy": {"mean": 0.5}}

    plain, private = round_figures(record), round_figures({**record, "privacy": {"epsilon": 0.7}})

    assert plain["participants"] == 3 and plain["mb_up"] == 3.0
    assert private == {"mb_down": 1.0, "seconds": 2.0, "accuracy": 0.5, "epsilon": 0.7}


def test_tensorboard_gets_every_rounds_figures_the_settings_and_the_report(federation):
    # Prepare
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    # Execute
    config, report = _tracked_run(federation, track="tensorboard")

    # Assert
    log_dir = federation.folder.path / "tensorboard"
    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    for name in ("accuracy", "mb_up", "mb_down", "participants", "selected"):
        assert name in scalars
        assert [event.step for event in accumulator.Scalars(name)] == [1, 2]
    accuracies = [event.value for event in accumulator.Scalars("accuracy")]
    assert accuracies == pytest.approx([r["personalized_accuracy"]["mean"] for r in report["rounds"]])
    assert [e.value for e in accumulator.Scalars("mb_up")] == pytest.approx([r["bytes_up"] / 1e6
                                                                            for r in report["rounds"]])
    assert [e.value for e in accumulator.Scalars("participants")] == [3, 3]
    assert "epsilon" not in scalars  # no DP
    hparams = HParamsPluginData.FromString(accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    assert hparams.session_start_info.hparams["run_id"].string_value == report["run_id"]
    assert hparams.session_start_info.hparams["rounds"].number_value == 2
    texts = {tag: accumulator.Tensors(tag)[0].tensor_proto.string_val[0].decode()
             for tag in accumulator.Tags()["tensors"] if tag.endswith("text_summary")}
    assert "| rounds | 2 |" in texts["settings/text_summary"]
    assert str(federation.folder.report.resolve()) in texts["report/text_summary"]
    assert report["run_id"] in texts["report/text_summary"]


def test_mlflow_gets_each_rounds_metrics_the_params_and_the_report_artifact(federation):
    # Prepare
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    # Execute
    config, report = _tracked_run(federation, track="mlflow")

    # Assert
    client = MlflowClient(tracking_uri=(federation.folder.path / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name(f"edgepfl-{config.broker.federation}")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == report["run_id"]
    history = client.get_metric_history(run.info.run_id, "accuracy")
    assert [m.step for m in history] == [1, 2]
    assert [m.value for m in history] == pytest.approx([r["personalized_accuracy"]["mean"] for r in report["rounds"]])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "mb_down")] == [1, 2]
    assert (run.data.params["rounds"], run.data.params["algorithm"], run.data.params["clients"]) == ("2", "fedavg", "3")
    assert json.loads(run.data.params["hyper"]) == {}
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert artifacts == ["report.json"]
    downloaded = client.download_artifacts(run.info.run_id, "report.json", str(federation.tmp_path))
    assert json.loads(open(downloaded).read())["run_id"] == report["run_id"]
