"""Upload codecs end to end over the loopback broker: a short FedAvg federation with each codec
completes with every update accepted, and the global model stays close to fp32's accuracy; under
topk each device keeps its error-feedback residual in its personal state, never upstream."""

from __future__ import annotations

import pytest

from edge_sdk.protocol import Kind
from edge_sdk.sparse_codec import RESIDUAL_PREFIX
from edge_sdk.store import PersonalStore
from loopback_runs import LoopbackFederation, drain

BASELINE: dict[str, float] = {}  # fp32's final personalized accuracy, run once per session


def _run(federation: LoopbackFederation, **changes) -> dict:
    """Three devices, three rounds of FedAvg on digits with `changes`; the run's report."""
    coordinator = federation.coordinator(federation.config(rounds=3, **changes))
    for index in range(3):
        federation.start_device(index, 3)
    return coordinator.run()


def _fp32_accuracy(tmp_path_factory) -> float:
    if "fp32" not in BASELINE:
        federation = LoopbackFederation(tmp_path_factory.mktemp("fp32"), "fed-codec-fp32")
        try:
            BASELINE["fp32"] = _run(federation)["final"]["personalized_accuracy"]["mean"]
        finally:
            federation.shutdown()
    return BASELINE["fp32"]


@pytest.mark.parametrize(("codec", "changes"), [
    ("int8", {}), ("q4", {}), ("q2", {}), ("topk", {"topk_fraction": 0.1})])
def test_a_fedavg_run_with_a_codec_completes_close_to_fp32(federation, tmp_path_factory, codec, changes):
    # Prepare
    baseline = _fp32_accuracy(tmp_path_factory)
    uploads = federation.spy(Kind.TRAIN_RES)

    # Execute
    report = _run(federation, upload_codec=codec, **changes)

    # Assert: every round complete, nothing refused, accuracy within a few points of fp32's
    assert [r["outcome"] for r in report["rounds"]] == ["complete"] * 3
    assert report["rejections"] == {}
    assert report["final"]["personalized_accuracy"]["mean"] >= baseline - (0.08 if codec in ("q2", "topk") else 0.03), (
        report["final"]["personalized_accuracy"]["mean"], baseline)
    sent = [name for envelope in drain(uploads) for group in envelope.groups.values() for name in group]
    assert sent and not any(name.startswith(RESIDUAL_PREFIX) for name in sent)
    if codec == "topk":  # the residual stays on the device, with its personal state
        saved = PersonalStore(federation.state_dir("dev000"), "dev000").load()
        assert saved is not None and any(key.startswith(RESIDUAL_PREFIX) for key in saved.arrays)
