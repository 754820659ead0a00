"""Which private runs can be made: every data-dependent message of a run under `--dp` is
treated by a mechanism, or the run is refused at start, naming the message.

An algorithm declares what its TRAIN_RES groups are (`ServerAlgorithm.upload_kinds`); the DP
mechanisms treat one kind, the change of shared parameters, which is clipped and noised. The
other messages of a run are treated here once for every algorithm:
- HELLO's example count and label counts: a device that sees a private run's STATUS sends
  neither, and the coordinator keeps none it receives;
- evaluation figures: accuracy only, released as a noised mean and accounted (or, with
  `dp_evaluation outside`, reported as measured and marked outside the guarantee);
- the weak devices' class prototypes: not pooled (they are withheld, nothing is asked);
- the release's BatchNorm statistics (algorithms that keep them personal): refused;
- rules that break the guarantee's arithmetic: robust aggregation, sharded sums, late updates
  folded into a later round, a norm cap under local noise; and `distributed` noise without
  secure aggregation, the only place where a share of the noise hides an update.
Record-level DP-SGD (`--dp-sgd`) is refused for an algorithm whose local loss is not a mean of
per-example terms, or a model with BatchNorm (`check_dp_sgd_run`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edge_sdk.config import ConfigError

if TYPE_CHECKING:
    from edge_sdk.models import ModelSpec

    from ..algorithms.base import ServerAlgorithm
    from ..config.run_config import RunConfig
    from .run import RunPrivacy

PARAMETERS = "parameters"
"""The upload kind DP treats: a change of shared parameters, clipped to C and noised."""
CLASS_STATISTICS = "class statistics"
"""Per-class feature means and covariances (DC-PFL): no DP mechanism of edgepfl treats them."""
TREATED = (PARAMETERS,)


def check_private_run(config: RunConfig, algorithm: ServerAlgorithm, *, needs_body_statistics: bool) -> None:
    """Refuse, before anything starts, a `--dp` run with a message no mechanism covers, naming
    it (ConfigError); a run without DP passes. `needs_body_statistics`: the release would pool
    the trainers' BatchNorm statistics of the global body."""
    privacy = config.privacy
    if not privacy.enabled:
        return
    if privacy.dp == "distributed" and not config.secagg.secure_aggregation:
        raise ConfigError("dp distributed: each device's share of the noise hides its update only under secure "
                          "aggregation: add --secure-aggregation, or use dp central or local")
    refusals = [
        (config.aggregation.rule != "mean", "aggregation",
         f"{config.aggregation.rule}: DP needs the fixed-denominator mean (mean)"),
        (config.round.shards > 0, "shards", "sharded sums are not yet noised: use shards 0 under DP"),
        (config.round.late_updates != "discard", "late_updates",
         "next_round folds a device's update into a round it was not sampled for: discard under DP"),
        (privacy.dp == "local" and config.round.max_update_norm > 0, "max_update_norm",
         "every update arrives noised under local DP and would exceed it: 0 under dp local"),
        (privacy.dp == "local" and privacy.dp_adaptive_clip, "dp_adaptive_clip",
         "needs the coordinator to noise the devices' count (dp central); under dp local each device's report "
         "would need noise of its own"),
        (privacy.dp == "distributed" and privacy.dp_adaptive_clip, "dp_adaptive_clip",
         "needs each device's within-clip report, which a masked upload does not carry: off under dp distributed"),
    ]
    for refused, key, why in refusals:
        if refused:
            raise ConfigError(f"{key} {why}")
    kinds = algorithm.upload_kinds()
    for group in algorithm.update_spec(1):
        kind = kinds.get(group)
        if kind is None:
            raise ConfigError(f"dp: {algorithm.id} uploads group {group!r}, whose kind it does not declare: no "
                              "mechanism can cover it")
        if kind not in TREATED:
            raise ConfigError(f"dp: {algorithm.id} uploads {kind} (TRAIN_RES group {group!r}), which no DP "
                              f"mechanism of edgepfl treats; DP covers {', '.join(TREATED)}")
    if needs_body_statistics:
        raise ConfigError(f"dp: releasing {algorithm.id}'s body pools the trainers' BatchNorm statistics (EVAL_RES "
                          "group 'statistics'), which no DP mechanism of edgepfl treats; run without release, or "
                          "with an algorithm that shares its statistics (repper) or a model without BatchNorm")


def check_dp_sgd_run(config: RunConfig, model: ModelSpec) -> None:
    """Refuse, before anything starts, `--dp-sgd` for an algorithm whose local loss is not a mean
    of per-example terms or a model whose layers mix a batch's examples (BatchNorm), naming why
    (ConfigError). A device with a model of its own is checked again when it joins."""
    if not config.privacy.dp_sgd:
        return
    from edge_sdk.algorithms import load
    from edge_sdk.models import build_model
    from edge_sdk.privacy.dpsgd import DpSgdRefused, check_dp_sgd

    try:
        check_dp_sgd(load(config.run.algorithm), build_model(model, config.task(), seed=config.training.seed))
    except DpSgdRefused as exc:
        raise ConfigError(str(exc)) from None


def private_run(config: RunConfig, algorithm: ServerAlgorithm, model: ModelSpec,
                record: dict[str, Any]) -> RunPrivacy | None:
    """The DP of a `--dp` run (`RunPrivacy`; None without `--dp`), after refusing by name
    (ConfigError) a run with a message no mechanism covers; the noise multiplier is calibrated
    here, before anything trains. `record` is the run's configuration as its checkpoint records
    it (to find what a release would pool)."""
    if not config.privacy.enabled:
        return None
    rounds = config.training.rounds
    releases = config.run.release or algorithm.releases_representation
    needs_statistics = False
    if releases and algorithm.shares_body():
        from ..releases.representation import body_statistics_needed

        needs_statistics = bool(body_statistics_needed(algorithm.state, record, run_id="", model=model))
    check_private_run(config, algorithm, needs_body_statistics=needs_statistics)
    from .run import RunPrivacy  # dp-accounting loads with a private run only

    evaluations = sum(1 for r in range(1, rounds + 1) if r % config.round.eval_every == 0 or r == rounds)
    return RunPrivacy(config.privacy, devices=config.run.clients,
                      population=config.run.clients - config.lite_devices - config.round.holdout_clients,
                      fraction=config.round.fraction, rounds=rounds, evaluations=evaluations + int(releases),
                      seed=config.training.seed)
