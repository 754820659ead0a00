"""Mutation check: each targeted break of a seed algorithm's objective (or of a switch) must make its tests fail.

Usage: `python tests/mutation_check.py [--jobs N] [--changed] [--record] [name-substring ...]` from the
repository root (the interpreter must have edgepfl's dependencies). The repository is copied to a
temporary folder once per job; each mutation (exact string replacements in one module) is applied to
a free copy, only its tests run there (an algorithm's objective tests, a switch's own) (`pytest -x`,
so a caught mutation stops at its first failing test), and the module is restored. The unmutated
tests must pass first (spread over the jobs with pytest-xdist), unless `--baseline-passed` says the
whole suite just passed on this tree, as `make test` does after running it. Mutations whose tests
run the command over a broker go first, so the jobs end together. Jobs default to the CPU count, at
most 4.

`--changed` runs only the mutations whose fingerprint (tests/mutation_ledger.py: the broken module
and the tests that must catch it) is not in `tests/mutations_caught.json`, the ledger of the last
full pass; `--record` writes the caught ones' fingerprints into it. Exit status 0 when every
mutation run was caught, 1 when one survived (they are listed), 2 when the baseline fails or a
mutation no longer applies (its text is not in the module exactly once).
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from mutation_ledger import LEDGER_NAME, fingerprint, read_ledger, write_ledger

ROOT = Path(__file__).resolve().parents[1]
IGNORED = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "runs", ".pytest_cache")


@dataclass(frozen=True)
class Mutation:
    """A named break: `replacements` (old, new) applied to `module`, to be caught by `tests`."""

    name: str
    module: str
    replacements: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]


FEDIOS = ("tests/unit/test_fedios_objective.py",)
ACCOUNTANT_PY, UPSTREAM_PY = "coordinator/privacy/accountant.py", "edge_sdk/privacy/upstream.py"
MECHANISM_PY, RUN_PRIVACY_PY = "coordinator/privacy/mechanism.py", "coordinator/privacy/run.py"
DPSGD_PY = "edge_sdk/privacy/dpsgd.py"
SECAGG_CLIENT_PY, SECAGG_SERVER_PY = "edge_sdk/secagg/client.py", "edge_sdk/secagg/server.py"
APFL_PY, APFL = "edge_sdk/algorithms/apfl.py", ("tests/unit/test_apfl_objective.py",)
FEDROD_PY, FEDROD = "edge_sdk/algorithms/fedrod.py", ("tests/unit/test_fedrod_objective.py",)
FEDALA_PY, FEDALA = "edge_sdk/algorithms/fedala.py", ("tests/unit/test_fedala_objective.py",)
FEDPROTO = ("tests/unit/test_fedproto_objective.py",)
FEDPROTO_PY, FEDPROTO_SERVER_PY = "edge_sdk/algorithms/fedproto.py", "coordinator/algorithms/fedproto.py"
SECAGG = ("tests/unit/test_secagg_protocol.py", "tests/unit/test_secagg_adversary.py")
SECAGG_ATTACKS = ("tests/unit/test_secagg_attacks.py",)
DISTRIBUTED_DP = ("tests/unit/test_loopback_distributed_dp.py",)
PRIVACY_ACCOUNTANT = ("tests/unit/test_privacy_accountant.py",)
PRIVACY_MECHANISMS = ("tests/unit/test_privacy_mechanisms.py",)
PRIVACY_AUDIT = ("tests/unit/test_privacy_audit.py",)
AUDIT_PY, AUDIT_RUN_PY = "coordinator/privacy/audit.py", "coordinator/privacy/audit_run.py"
PRIVACY_LOOPBACK = "tests/unit/test_loopback_privacy.py::"
MATRIX = "tests/unit/test_compatibility_matrix.py::"
PRIVACY_LOOPBACK_BUDGET = (f"{PRIVACY_LOOPBACK}test_a_run_stops_when_its_budget_is_spent_and_a_resume_continues_the_"
                           "accountant",)
PRIVACY_LOOPBACK_ADAPTIVE = (f"{PRIVACY_LOOPBACK}test_the_adaptive_clip_rule_and_the_split_of_the_noise",)
PRIVACY_LOOPBACK_ADAPTIVE_EPSILON = (f"{PRIVACY_LOOPBACK}test_adaptive_clipping_is_accounted_as_the_update_and_the_"
                                    "count_at_their_true_sensitivities",)
PRIVACY_LOOPBACK_EPSILON = (f"{PRIVACY_LOOPBACK}test_the_epsilon_a_run_reports_is_dp_accounting_s_for_its_rounds_and_"
                            "evaluations",)
DUALFED = ("tests/unit/test_dualfed_objective.py",)
REPPER = ("tests/unit/test_repper_objective.py",)
CD2 = ("tests/unit/test_cd2_pfed_objective.py",)
CD2_SCHEDULE = ("tests/unit/test_cd2_pfed.py",)
DC_PFL = ("tests/unit/test_dc_pfl_objective.py",)
FEDIOS_PY, DUALFED_PY = "edge_sdk/algorithms/fedios.py", "edge_sdk/algorithms/dualfed.py"
FEDIOS_HYPER_PY = "edge_sdk/algorithms/hyper/fedios.py"
REPPER_PY, CD2_PY = "edge_sdk/algorithms/repper.py", "edge_sdk/algorithms/cd2_pfed.py"
DC_PFL_PY, DC_PFL_SERVER_PY = "edge_sdk/algorithms/dc_pfl.py", "coordinator/algorithms/dc_pfl.py"
CD2_SERVER_PY = "coordinator/algorithms/cd2_pfed.py"
SIMULATE_PY = "coordinator/hosting/simulate.py"
SIMULATE_SHARDS = "tests/integration/test_simulate_shards.py"
COMMON_OPTIMIZER = ("tests/unit/test_common_optimizer.py",)
FAIR_SETTINGS = ("tests/unit/test_fair_settings.py",)
VALIDATION_RUN = ("tests/unit/test_loopback_validation.py::"
                  "test_a_validation_run_trains_and_scores_on_the_training_split_only",)
TORCH_DEVICE_PY, PART_SHARING_PY = "edge_sdk/algorithms/torch_device.py", "edge_sdk/algorithms/part_sharing.py"
CLIENT_PY, CLIENT_DATA_PY = "edge_sdk/client.py", "edge_sdk/data/client_data.py"
ALGORITHMS_INIT_PY, REGISTRIES = "edge_sdk/algorithms/__init__.py", ("tests/unit/test_registries.py",)
SYNC_ROUNDS_PY, CONFIG_PY = "coordinator/players/sync.py", "coordinator/config/run_config.py"
LITE_CLIENT_PY, CLI_PY = "edge_sdk/lite/client.py", "coordinator/cli.py"
LITE_VALIDATION_RUN = ("tests/unit/test_loopback_weak_devices.py::"
                       "test_a_weak_device_in_a_validation_run_fits_and_scores_on_its_training_split_only",)

MUTATIONS = (
    # FediOS: Eq. (9)-(12)
    Mutation("fedios: no fused-feature CE", FEDIOS_PY,
             (("for phi in (model.fuse(phi_g, phi_p), phi_g, phi_p)", "for phi in (phi_g, phi_p)"),), FEDIOS),
    Mutation("fedios: no generic CE", FEDIOS_PY,
             (("for phi in (model.fuse(phi_g, phi_p), phi_g, phi_p)", "for phi in (model.fuse(phi_g, phi_p), phi_p)"),),
             FEDIOS),
    Mutation("fedios: alpha ignored", FEDIOS_PY,
             (("return self.alpha * phi_g + (1.0 - self.alpha) * phi_p", "return 0.5 * phi_g + 0.5 * phi_p"),), FEDIOS),
    Mutation("fedios: alpha on the personal features", FEDIOS_PY,
             (("return self.alpha * phi_g + (1.0 - self.alpha) * phi_p",
               "return (1.0 - self.alpha) * phi_g + self.alpha * phi_p"),), FEDIOS),
    Mutation("fedios: personal features projected into the generic block", FEDIOS_PY,
             (("return project(features, self.block, self.head.in_features)",
               "return project(features, 0, self.head.in_features)"),), FEDIOS),
    Mutation("fedios: global model on the fused features", FEDIOS_PY,
             (("return self.head(self.generic_features(x))", "return self(x)"),), FEDIOS),
    Mutation("fedios: no orthogonality term", FEDIOS_PY,
             (("return ce + lam * orthogonality(*pair)", "return ce"),), FEDIOS),
    Mutation("fedios: reconstructed L_re on the projected features", FEDIOS_PY,
             (("pair = (generic, personal) if l_re == \"extractors\" else (phi_g, phi_p)",
               "pair = (phi_g, phi_p)"),), FEDIOS),
    Mutation("fedios: printed L_re computes the reconstruction", FEDIOS_PY,
             (("pair = (generic, personal) if l_re == \"extractors\" else (phi_g, phi_p)",
               "pair = (generic, personal)"),), FEDIOS),
    Mutation("fedios: default L_re is the reconstruction", FEDIOS_HYPER_PY,
             (("l_re: Literal[\"projected\", \"extractors\"] = \"projected\"",
               "l_re: Literal[\"projected\", \"extractors\"] = \"extractors\""),), FEDIOS),
    Mutation("fedios: orthogonality without lambda", FEDIOS_PY,
             (("return ce + lam * orthogonality(*pair)", "return ce + orthogonality(*pair)"),), FEDIOS),
    Mutation("fedios: orthogonality detaches the personal extractor", FEDIOS_PY,
             (("pair = (generic, personal) if", "pair = (generic, personal.detach()) if"),), FEDIOS),
    Mutation("fedios: orthogonality without the absolute value", FEDIOS_PY,
             (("return (generic * personal).sum(dim=1).abs().mean()",
               "return (generic * personal).sum(dim=1).mean()"),), FEDIOS),
    # FediOS without the personal extractor (Table 7): CE(head(phi_g)) alone (fedios.py's Decision)
    Mutation("fedios: ablation keeps the personal CE", FEDIOS_PY,
             (("return F.cross_entropy(model.head(phi_g), yb)",
               "return F.cross_entropy(model.head(phi_g), yb)"
               " + F.cross_entropy(model.head(model.personal_features(xb)), yb)"),),
             FEDIOS),
    Mutation("fedios: ablation counts the generic CE as the fused one too", FEDIOS_PY,
             (("return F.cross_entropy(model.head(phi_g), yb)", "return 2 * F.cross_entropy(model.head(phi_g), yb)"),),
             FEDIOS),
    Mutation("fedios: device loss ignores personal_extractor", FEDIOS_PY,
             (("return fedios_loss(self.model, self.hyper.lam, self.hyper.l_re, self.hyper.personal_extractor)",
               "return fedios_loss(self.model, self.hyper.lam, self.hyper.l_re)"),), FEDIOS),
    Mutation("fedios: device loss ignores l_re", FEDIOS_PY,
             (("return fedios_loss(self.model, self.hyper.lam, self.hyper.l_re, self.hyper.personal_extractor)",
               "return fedios_loss(self.model, self.hyper.lam, \"projected\", self.hyper.personal_extractor)"),),
             FEDIOS),
    # DualFed: Eq. (5)-(10)
    Mutation("dualfed: no SupCon term", DUALFED_PY,
             (("return ce + self.hyper.lam * contrastive", "return ce"),), DUALFED),
    Mutation("dualfed: lambda ignored", DUALFED_PY,
             (("return ce + self.hyper.lam * contrastive", "return ce + contrastive"),), DUALFED),
    Mutation("dualfed: SupCon on the body's features", DUALFED_PY,
             (("supcon_loss(u.view(len(yb), 2, -1)", "supcon_loss(model.body(views).view(len(yb), 2, -1)"),), DUALFED),
    Mutation("dualfed: CE labels paired with the wrong views", DUALFED_PY,
             (("yb.repeat_interleave(2)", "yb.repeat(2)"),), DUALFED),
    Mutation("dualfed: ensemble of the personal head alone", DUALFED_PY,
             (("return F.softmax(global_logits, dim=1) + F.softmax(personal_logits, dim=1)",
               "return F.softmax(personal_logits, dim=1)"),), ("tests/unit/test_dualfed.py",)),
    # RepPer: Eq. (4)-(5)
    Mutation("repper: shuffled SupCon labels", REPPER_PY,
             (("return supcon_loss(embeddings, yb,", "return supcon_loss(embeddings, yb.roll(1),"),), REPPER),
    Mutation("repper: a single view", REPPER_PY,
             (("embeddings = self.model(views.flatten(0, 1)).view(len(yb), 2, -1)",
               "embeddings = self.model(views[:, 0]).view(len(yb), 1, -1)"),), REPPER),
    Mutation("repper: views not augmented", REPPER_PY,
             (("views = task_views(xb, task, generator)", "views = torch.stack([xb, xb], dim=1)"),), REPPER),
    Mutation("repper: variant ignored", REPPER_PY,
             (("self.hyper.temperature, self.hyper.variant)", "self.hyper.temperature, \"out\")"),), REPPER),
    # CD2-pFed: Eq. (3)-(5)
    Mutation("cd2_pfed: no distillation", CD2_PY,
             (("return ce + self.hyper.lam * distillation_loss(", "return ce + 0.0 * distillation_loss("),), CD2),
    Mutation("cd2_pfed: distillation without lambda", CD2_PY,
             (("return ce + self.hyper.lam * distillation_loss(", "return ce + distillation_loss("),), CD2),
    Mutation("cd2_pfed: sub-networks swapped", CD2_PY,
             (("logits_global = self.subnet_logits(xb, keep_shared, self.gw0_stats)",
               "logits_global = self.subnet_logits(xb, keep_personal, self.gw0_stats)"),
              ("logits_local = self.subnet_logits(xb, keep_personal, scratch)",
               "logits_local = self.subnet_logits(xb, keep_shared, scratch)")), CD2),
    Mutation("cd2_pfed: each KL detaches the wrong side", CD2_PY,
             (("F.kl_div(F.log_softmax(student, dim=1), F.log_softmax(teacher.detach(), dim=1)",
               "F.kl_div(F.log_softmax(student.detach(), dim=1), F.log_softmax(teacher, dim=1)"),), CD2),
    Mutation("cd2_pfed: the 1/2 of Eq. (4) dropped", CD2_PY,
             (("return 0.5 * (distill(logits_local, logits_global) + distill(logits_global, logits_local))",
               "return distill(logits_local, logits_global) + distill(logits_global, logits_local)"),), CD2),
    Mutation("cd2_pfed: default without the in-place term", CD2_PY,
             (("return inplace + cyclic_distillation(logits_local, logits_global)",
               "return cyclic_distillation(logits_local, logits_global)"),), CD2),
    Mutation("cd2_pfed: default without the cyclic term", CD2_PY,
             (("return inplace + cyclic_distillation(logits_local, logits_global)", "return inplace"),), CD2),
    Mutation("cd2_pfed: in-place term teaches the shared sub-network only", CD2_PY,
             (("return 0.5 * (distill(logits_full, logits_global) + distill(logits_full, logits_local))",
               "return 0.5 * distill(logits_full, logits_global)"),), CD2),
    Mutation("cd2_pfed: in-place teacher is the personal sub-network", CD2_PY,
             (("return 0.5 * (distill(logits_full, logits_global) + distill(logits_full, logits_local))",
               "return 0.5 * (distill(logits_local, logits_global) + distill(logits_full, logits_local))"),), CD2),
    Mutation("cd2_pfed: distillation form ignored", CD2_PY,
             (("if kind == \"cyclic\":", "if kind == \"cyclic-only\":"),), CD2),
    Mutation("cd2_pfed: head split along its outputs", CD2_PY,
             (("return 1 if ndim == 2 else None", "return 0 if ndim == 2 else None"),), CD2),
    Mutation("cd2_pfed: global accuracy of the personal sub-network", CD2_PY,
             (("keep_shared = {k: (~m).to(torch.float32) for k, m in self.masks(task.round).items()}",
               "keep_shared = {k: m.to(torch.float32) for k, m in self.masks(task.round).items()}"),), CD2),
    # CD2-pFed without LI (Table 5): `ramp=false` keeps p_t = p from round 1
    Mutation("cd2_pfed: ramp switch ignored", CD2_PY,
             (("    if not ramp:\n        return p if round_ >= 1 else 0.0\n", ""),), CD2_SCHEDULE),
    Mutation("cd2_pfed: device ignores ramp", CD2_PY,
             (("personal_fraction(self.hyper.p, round_, self.settings.rounds, self.hyper.ramp)",
               "personal_fraction(self.hyper.p, round_, self.settings.rounds)"),), CD2_SCHEDULE),
    Mutation("cd2_pfed: server ignores ramp", CD2_SERVER_PY,
             (("personal_fraction(self.hyper.p, round_, self.context.rounds, self.hyper.ramp)",
               "personal_fraction(self.hyper.p, round_, self.context.rounds)"),), CD2_SCHEDULE),
    # DC-PFL: Eq. (4), (8)-(12)
    Mutation("dc_pfl: auxiliary loss without its lambda", DC_PFL_PY,
             (("value = value + self.hyper.lam * distance.mean()", "value = value + distance.mean()"),), DC_PFL),
    Mutation("dc_pfl: auxiliary loss also for classes without a mean", DC_PFL_PY,
             (("distance = ((z - mu[yb]) ** 2).sum(dim=1) * has_mean[yb]",
               "distance = ((z - mu[yb]) ** 2).sum(dim=1)"),), DC_PFL),
    Mutation("dc_pfl: server step with the wrong targets", DC_PFL_SERVER_PY,
             (("nn.functional.cross_entropy(logits, torch.as_tensor(present))",
               "nn.functional.cross_entropy(logits, torch.arange(len(present)))"),), DC_PFL),
    Mutation("dc_pfl: server without calibration", DC_PFL_SERVER_PY,
             (("loss = self._calibrate(head, optimizer, features, labels, round_)", "loss = float(\"nan\")"),), DC_PFL),
    Mutation("dc_pfl: server steps in arrival order", DC_PFL_SERVER_PY,
             (("for cid in sorted(self._reports)]", "for cid in self._reports]"),), DC_PFL),
    # simulate --local-aggregators: the shard aggregators simulate hosts
    Mutation("local_aggregators: key ignored (every shard hosted)", CONFIG_PY,
             (("return parse_shards(self.simulation.local_aggregators, self.round.shards, \"local_aggregators\")",
               "return tuple(range(self.round.shards))"),), ("tests/unit/test_workers_checks.py",)),
    Mutation("local_aggregators: simulate starts no aggregator", SIMULATE_PY,
             (("AggregatorPool(config, config.local_shards, url)", "AggregatorPool(config, (), url)"),),
             (f"{SIMULATE_SHARDS}::test_simulate_with_two_shards_alone_gives_the_unsharded_global_state",)),
    Mutation("local_aggregators: remote aggregators without broker or federation", SIMULATE_PY,
             (("if remote_shards and not connected:", "if False:"),),
             (f"{SIMULATE_SHARDS}::test_aggregators_on_other_hosts_need_broker_and_federation",)),
    Mutation("local_aggregators: a dead aggregator not reported", SIMULATE_PY,
             (("        aggregators.watch(hosting.done)\n", ""),),
             (f"{SIMULATE_SHARDS}::test_a_local_aggregator_that_dies_is_logged_and_its_shard_lost",)),
    # the fair protocol's switches: the common optimizer and the validation split
    Mutation("fair: optimizer=sgd ignored", TORCH_DEVICE_PY,
             (('if settings.optimizer == "sgd":', "if False:"),), COMMON_OPTIMIZER),
    Mutation("fair: common SGD without the run's momentum", TORCH_DEVICE_PY,
             (("momentum=settings.sgd_momentum,", "momentum=0.9,"),), COMMON_OPTIMIZER),
    Mutation("fair: common SGD without the run's weight decay", TORCH_DEVICE_PY,
             (("weight_decay=settings.sgd_weight_decay)", ")"),), COMMON_OPTIMIZER),
    Mutation("fair: the FedAvg family's SGD bypasses the common optimizer", PART_SHARING_PY,
             (("return self.local_optimizer(params, lambda own: torch.optim.SGD(",
               "return (lambda own: torch.optim.SGD("),
              ("momentum=momentum))", "momentum=momentum))(list(params))")), COMMON_OPTIMIZER),
    Mutation("fair: RepPer's head bypasses the common optimizer", REPPER_PY,
             (("make_optimizer = sgd_head_optimizer(lr) if optimizer is None else optimizer",
               "make_optimizer = sgd_head_optimizer(lr)"),), COMMON_OPTIMIZER),
    Mutation("fair: the validation split ignored by the device", CLIENT_PY,
             (("data = self.data.for_run(settings.validation_fraction, seed)",
               "data = self.data"),), VALIDATION_RUN),
    Mutation("fair: the validation split ignored by a weak device", LITE_CLIENT_PY,
             (("self.data = self.own_data.for_run(settings.validation_fraction, device_seed(settings.seed, "
               "self.client_id))",
               "self.data = self.own_data"),), LITE_VALIDATION_RUN),
    Mutation("fair: the held-out split is the training data", CLIENT_DATA_PY,
             (("self.train_x[held_idx],", "self.train_x[train_idx],"),), FAIR_SETTINGS),
    Mutation("fair: the held-out split ignores its seed", CLIENT_DATA_PY,
             (("stratified_split(self.train_y, fraction, seed=seed)",
               "stratified_split(self.train_y, fraction, seed=0)"),),
             FAIR_SETTINGS),
    Mutation("fair: a validation run reported as scored on test", "coordinator/run/records.py",
             (('"validation" if config.training.validation_fraction else "test"', '"test"'),), VALIDATION_RUN),
    Mutation("fair: a later setting defines every run, default or not", CONFIG_PY,
             (("if_set = item.info.defines == DEFINES_IF_SET and value != item.field.default",
               "if_set = item.info.defines == DEFINES_IF_SET and bool(value)"),), ("tests/unit/test_settings.py",)),
    # repeatable runs: the coordinator's round step on one thread, whatever the machine
    Mutation("repeat: end_round on the default threads", "coordinator/algorithms/base.py",
             (("        with one_thread():\n            self.end_round(round_)", "        self.end_round(round_)"),),
             ("tests/unit/test_server_threads.py",)),
    # stopping a command: SIGTERM unwinds it like Ctrl-C, so simulate stops its processes
    Mutation("cli: SIGTERM kills the command without unwinding", CLI_PY,
             (("    _unwind_on_sigterm()\n    try:", "    try:"),),
             ("tests/integration/test_stop_signals.py::test_a_signal_stops_simulate_with_its_code_and_one_line_"
              "leaving_nothing_and_a_consistent_run[registration-sigterm-process]",)),
    # differential privacy: the accountant, the clip, the noise, the budget and a resume's accountant
    Mutation("dp: replace-one sensitivity C instead of 2C", ACCOUNTANT_PY,
             (("base = dp_accounting.GaussianDpEvent(release.noise / 2)",
               "base = dp_accounting.GaussianDpEvent(release.noise)"),), PRIVACY_ACCOUNTANT),
    Mutation("dp: local DP accounted with amplification by sampling", ACCOUNTANT_PY,
             (("return dp_accounting.GaussianDpEvent(noise / 2 if sampling == \"fixed\" else noise)",
               "return dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(noise))"),),
             PRIVACY_ACCOUNTANT),
    Mutation("dp: the device clips to twice C", UPSTREAM_PY,
             (("scale = min(1.0, bound / norm) if norm > 0 else 1.0",
               "scale = min(1.0, 2 * bound / norm) if norm > 0 else 1.0"),), PRIVACY_MECHANISMS),
    Mutation("dp: local noise of z instead of z*C", UPSTREAM_PY,
             (("        if self.local:\n            return self.noise * clip\n",
               "        if self.local:\n            return self.noise\n"),), PRIVACY_MECHANISMS),
    Mutation("dp: the coordinator trusts the devices' clipping", MECHANISM_PY,
             (("scale = self.clip / norm if self.clip > 0 and norm > self.clip else 1.0", "scale = 1.0"),),
             PRIVACY_MECHANISMS),
    Mutation("dp: the aggregate's noise divided by m twice", MECHANISM_PY,
             (("mean = (total + noise) / self.expected", "mean = (total + noise / self.expected) / self.expected"),),
             PRIVACY_MECHANISMS),
    Mutation("dp: the mean over the replies instead of the fixed denominator", MECHANISM_PY,
             (("mean = (total + noise) / self.expected", "mean = (total + noise) / self.count"),),
             PRIVACY_MECHANISMS),
    # the privacy audit: its statistics, and the real mechanisms' noise cut, which the audit must catch
    Mutation("audit: the bound without its delta term", AUDIT_PY,
             (("return min(1.0, tail + 2 * canaries * delta * alpha)", "return min(1.0, tail)"),), PRIVACY_AUDIT),
    Mutation("audit: randomized response of accuracy e^2eps / (1 + e^2eps)", AUDIT_PY,
             (("q = 1.0 / (1.0 + math.exp(-epsilon))", "q = 1.0 / (1.0 + math.exp(-2 * epsilon))"),), PRIVACY_AUDIT),
    Mutation("audit: in and out guesses swapped", AUDIT_PY,
             (("guessed_in = order[len(order) - guess_in:] if guess_in else order[:0]",
               "guessed_in = order[:guess_in]"),), PRIVACY_AUDIT),
    Mutation("audit: the test switch leaves the coordinator's noise alone", AUDIT_RUN_PY,
             (("            aggregate.std *= _noise_scale\n", ""),), PRIVACY_AUDIT),
    Mutation("audit catches: the coordinator's noise a tenth of z*C", MECHANISM_PY,
             (("noise = self.rng.normal(0.0, self.std, size=total.shape)",
               "noise = self.rng.normal(0.0, self.std / 10, size=total.shape)"),), PRIVACY_AUDIT),
    Mutation("audit catches: a distributed share of z*C/m instead of z*C/sqrt(m)", UPSTREAM_PY,
             (("return self.noise * clip / math.sqrt(shares)", "return self.noise * clip / shares"),),
             PRIVACY_AUDIT),
    Mutation("dp: the budget overrun by a round", RUN_PRIVACY_PY,
             (("        after = self._epsilon_after_round(population)\n        if after > budget:",
               "        after = self._epsilon_after_round(population)\n        if self.epsilon() > budget:"),),
             PRIVACY_LOOPBACK_BUDGET),
    Mutation("dp: a resume restarts the accountant", "coordinator/players/run_state.py",
             (("        privacy.restore(saved.history[\"privacy\"])\n", "        pass\n"),), PRIVACY_LOOPBACK_BUDGET),
    Mutation("dp: the sampled rounds left out of a run's epsilon", RUN_PRIVACY_PY,
             (("            self.accountant.add_round(population, self._sample(population), noise)\n",
               "            pass\n"),), PRIVACY_LOOPBACK_EPSILON),
    Mutation("dp: adaptive clipping moves C the wrong way", RUN_PRIVACY_PY,
             (("(share - self.settings.dp_clip_quantile)", "(self.settings.dp_clip_quantile - share)"),),
             PRIVACY_LOOPBACK_ADAPTIVE),
    Mutation("dp: adaptive clipping's count noise not taken from the update's", RUN_PRIVACY_PY,
             (("return (self.noise ** -2 - (2 * self.count_noise) ** -2) ** -0.5", "return self.noise"),),
             PRIVACY_LOOPBACK_ADAPTIVE),
    Mutation("dp: adaptive clipping's count of 0/1 bits, not centred", MECHANISM_PY,
             (("    return sum(b - 0.5 for b in within)", "    return sum(within)"),
              ("return (centred_count(within) + noise) / expected + 0.5",
               "return (centred_count(within) + noise) / expected"),), PRIVACY_LOOPBACK_ADAPTIVE_EPSILON),
    Mutation("dp: adaptive clipping's count noise split as if of sensitivity 1", RUN_PRIVACY_PY,
             (("return (self.noise ** -2 - (2 * self.count_noise) ** -2) ** -0.5",
               "return (self.noise ** -2 - self.count_noise ** -2) ** -0.5"),), PRIVACY_LOOPBACK_ADAPTIVE_EPSILON),
    Mutation("dp: the default delta devices^-1.1", "edge_sdk/privacy/settings.py",
             (("return min(DELTA_CAP, DELTA_SHARE / max(1, individuals))", "return float(individuals) ** -1.1"),),
             PRIVACY_ACCOUNTANT),
    Mutation("dp: a delta of 1 / N or more taken", "edge_sdk/privacy/settings.py",
             (("    if given * max(1, individuals) >= 1:", "    if given > 1:"),), PRIVACY_ACCOUNTANT),
    Mutation("dp distributed: the fleet's epsilon at z after dropouts, not z sqrt(s / m)", RUN_PRIVACY_PY,
             (("self.exposure.get(client_id, 0.0) + count * noise ** -2",
               "self.exposure.get(client_id, 0.0) + count * self.noise ** -2"),), DISTRIBUTED_DP),
    Mutation("dp distributed: the devices report their accuracy as measured", UPSTREAM_PY,
             (("        return self.local or self.distributed\n", "        return self.local\n"),), DISTRIBUTED_DP),
    Mutation("dp-sgd: a device takes a delta of 1 / its examples or more", "edge_sdk/client.py",
             (("self.dp_sgd_delta = self._dp_sgd_delta(privacy, data.num_train) if privacy.dp_sgd else 0.0",
               "self.dp_sgd_delta = privacy.dp_sgd_delta or 1e-5"),),
             ("tests/unit/test_model_registration.py::test_a_device_refuses_a_dp_sgd_delta_of_one_over_its_examples_"
              "or_more_by_name",)),
    Mutation("dp-sgd: no per-example clipping", DPSGD_PY,
             (("max_grad_norm=self.max_grad_norm,", "max_grad_norm=1e9,"),),
             ("tests/unit/test_dpsgd.py",)),
    Mutation("dp-sgd: shuffled batches accounted as Poisson ones", DPSGD_PY,
             (("idx = torch.nonzero(torch.rand(n, generator=batches) < rate).flatten()",
               "idx = torch.randperm(n, generator=batches)[:batch_size]"),), ("tests/unit/test_dpsgd.py",)),
    Mutation("dp-sgd: batches drawn from the run's seed, accounted as secret", DPSGD_PY,
             (("batches = generator if self.reproducible else self._secret_batches", "batches = generator"),),
             ("tests/unit/test_dpsgd.py",)),
    Mutation("dp-sgd: batches from the run's seed accounted with amplification", DPSGD_PY,
             (("return 1.0 if self.reproducible else rate", "return rate"),), ("tests/unit/test_dpsgd.py",)),
    # secure aggregation (SecAgg+): the masks cancel, the shares revealed, the consistency rule, the threshold
    Mutation("secagg: both ends of a pair add the pairwise mask", SECAGG_CLIENT_PY,
             (("masks.append((seed, self.client_id > peer))", "masks.append((seed, False))"),), SECAGG),
    Mutation("secagg: the self-mask shares of the dropped revealed", SECAGG_CLIENT_PY,
             (("b_shares = {peer: self._held_b[peer] for peer in self.shared_with & survivors}",
               "b_shares = {peer: self._held_b[peer] for peer in self.shared_with}"),), SECAGG),
    Mutation("secagg: a peer named both survivor and dropped is answered", SECAGG_CLIENT_PY,
             (("        if both:\n", "        if False:\n"),), SECAGG),
    Mutation("secagg: the server unmasks below the threshold", SECAGG_SERVER_PY,
             (("            if len(got) < self.context.threshold:", "            if len(got) < 1:"),), SECAGG),
    # the consistency stage and the graph seed nobody chooses
    Mutation("secagg: an unmask request answered without the consistency check", SECAGG_CLIENT_PY,
             (("        if survivors != self.signed:\n", "        if False:\n"),
              ("                self.roster.verify(peer, payload[peer], signatures[peer])\n", "                pass\n"),
              ("        if len(payload) < self.context.threshold:\n", "        if False:\n")), SECAGG_ATTACKS),
    Mutation("secagg: fewer than threshold neighbours' signatures accepted", SECAGG_CLIENT_PY,
             (("        if len(payload) < self.context.threshold:\n", "        if len(payload) < 1:\n"),),
             SECAGG_ATTACKS),
    Mutation("secagg: a survivor set naming withheld senders signed", SECAGG_CLIENT_PY,
             (("        if withheld:\n", "        if False:\n"),), SECAGG_ATTACKS),
    Mutation("secagg: a device takes an advertise stage that names a graph seed", "edge_sdk/secagg/device.py",
             (("        if stages.GRAPH_SEED in config:\n", "        if False:\n"),),
             ("tests/unit/test_secagg_stages.py",)),
    Mutation("secagg: the graph seed leaves out the advertisements", "edge_sdk/secagg/consistency.py",
             (("    for device in sorted(adverts):\n", "    for device in sorted(adverts)[:0]:\n"),), SECAGG_ATTACKS),
    # secure aggregation within shards: one weight scale for every shard, the aggregator's sum mod 2^32
    Mutation("secagg shards: each shard weights by its own largest device", "coordinator/players/secure.py",
             (("private=private, largest=max(examples.values()))", "private=private)"),),
             ("tests/unit/test_loopback_secagg.py",)),
    Mutation("secagg shards: the aggregator keeps only the last masked vector", "coordinator/shards/aggregator.py",
             (("                round_.masked_sum += masked\n", "                round_.masked_sum[:] = masked\n"),),
             ("tests/unit/test_shard_aggregator.py",)),
    Mutation("secagg shards: a masked sum over a device that did not share keys is taken", SECAGG_SERVER_PY,
             (("        strangers = [s for s in senders if s not in self._shared]",
               "        strangers: list[str] = []"),), SECAGG),
    # the release pools as secure sums: E[x^2] for the variance, each class weighted by its count
    Mutation("secagg pools: a variance summed without its mean's square", "edge_sdk/secagg/pools.py",
             (("            value = value + np.asarray(mean, dtype=np.float64) ** 2\n", ""),),
             ("tests/unit/test_secagg_pools.py",)),
    Mutation("secagg pools: class means summed unweighted", "edge_sdk/secagg/pools.py",
             (("    terms = weights[:, None] * np.clip(means, -bound, bound)",
               "    terms = (weights[:, None] > 0) * np.clip(means, -bound, bound)"),),
             ("tests/unit/test_secagg_pools.py",)),
    # distributed DP under secure aggregation: each device's share of the noise, dropout-aware accounting
    Mutation("dp distributed: each device adds the whole noise", UPSTREAM_PY,
             (("return self.noise * clip / math.sqrt(shares)", "return self.noise * clip"),), DISTRIBUTED_DP),
    Mutation("dp distributed: a round with dropouts accounted with the full noise", RUN_PRIVACY_PY,
             (("return self.noise * math.sqrt(min(self.summed, expected) / expected)", "return self.noise"),),
             DISTRIBUTED_DP),
    # APFL: w as FedAvg, v on F_k(alpha v + (1 - alpha) w), alpha learned and kept in [0, 1]; FedRoD: the
    # balanced softmax for the shared body and generic head, a personal head on detached features
    Mutation("apfl: w not detached in v_bar", APFL_PY,
             (("(1 - alpha) * w[name].detach()", "(1 - alpha) * w[name]"),), APFL),
    Mutation("apfl: mixture weights swapped", APFL_PY,
             (("alpha * v + (1 - alpha) * w[name].detach()", "(1 - alpha) * v + alpha * w[name].detach()"),), APFL),
    Mutation("apfl: v descends F_k(v), not F_k(v_bar)", APFL_PY,
             (("self.objective(self.mixed)", "self.objective(self.personal)"),), APFL),
    Mutation("apfl: w not trained", APFL_PY,
             (("return lambda xb, yb: global_loss(xb, yb) + personal_loss(xb, yb)",
               "return lambda xb, yb: personal_loss(xb, yb)"),), APFL),
    Mutation("apfl: alpha never steps", APFL_PY,
             (('"params": [alpha], "lr": lr,', '"params": [alpha], "lr": 0.0,'),), APFL),
    Mutation("apfl: alpha not projected onto [0, 1]", APFL_PY,
             (("alpha.clamp_(0.0, 1.0)", "alpha.clamp_(-1e9, 1e9)"),), APFL),
    Mutation("apfl: a fixed alpha steps", APFL_PY,
             (("self.mixed.alpha.requires_grad_(self.hyper.adaptive)", "self.mixed.alpha.requires_grad_(True)"),
              ("        if self.hyper.adaptive:\n            alpha = self.mixed.alpha",
               "        if True:\n            alpha = self.mixed.alpha")), APFL),
    Mutation("apfl: a new client keeps its initial v", APFL_PY,
             (("global_accuracy = self.test_accuracy(self.model)\n        if not self.trained:\n"
               "            self.start_personal()", "global_accuracy = self.test_accuracy(self.model)"),), APFL),
    Mutation("apfl: deploys w", APFL_PY,
             (('"accuracy": self.test_accuracy(self.mixed)', '"accuracy": self.test_accuracy(self.model)'),), APFL),
    Mutation("apfl: a restart forgets alpha", APFL_PY,
             (("self.mixed.alpha.fill_(alpha)", "self.mixed.alpha.fill_(self.hyper.alpha)"),), APFL),
    Mutation("fedrod: no class prior", FEDROD_PY,
             (("F.cross_entropy(generic + prior, yb)", "F.cross_entropy(generic, yb)"),), FEDROD),
    Mutation("fedrod: prior of the present classes only", FEDROD_PY,
             (("return (counts / counts.sum()).log()", "return (counts > 0).float().log()"),), FEDROD),
    Mutation("fedrod: personal loss reaches the body", FEDROD_PY,
             (("model.personal_head(z.detach())", "model.personal_head(z)"),), FEDROD),
    Mutation("fedrod: personal loss reaches the generic head", FEDROD_PY,
             (("generic.detach() + model.personal_head", "generic + model.personal_head"),), FEDROD),
    Mutation("fedrod: personal head without the generic logits", FEDROD_PY,
             (("generic.detach() + model.personal_head(z.detach())", "model.personal_head(z.detach())"),), FEDROD),
    Mutation("fedrod: personal head starts random", FEDROD_PY,
             (("        nn.init.zeros_(self.personal_head.weight)\n", ""),), FEDROD),
    Mutation("fedrod: deploys the generic head alone", FEDROD_PY,
             (("return self.head(z) + self.personal_head(z)", "return self.head(z)"),), FEDROD),
    Mutation("fedrod: personal head shared", FEDROD_PY,
             (('shared_parts = ("body", "head")', 'shared_parts = ("body", "head", "personal_head")'),), FEDROD),
    # FedALA: theta_hat = theta_i + (theta^t - theta_i) * W on the top layers, W's clipped steps, the first
    # aggregation until the loss settles and one iteration later, FedAvg's upload from theta_hat
    Mutation('fedala: W ascends the loss', FEDALA_PY,
             (('w.sub_(self.hyper.eta * g)', 'w.add_(self.hyper.eta * g)'),), FEDALA),
    Mutation('fedala: eta ignored', FEDALA_PY,
             (('w.sub_(self.hyper.eta * g)', 'w.sub_(g)'),), FEDALA),
    Mutation('fedala: W not clipped into [0, 1]', FEDALA_PY,
             (('.clamp_(0.0, 1.0)', '.clamp_(-1e9, 1e9)'),), FEDALA),
    Mutation("fedala: W weighs the local model's side", FEDALA_PY,
             (('self.local[name] + self.differences[name] * w ', 'self.local[name] + self.differences[name] * (1 - w) '),), FEDALA),
    Mutation('fedala: every layer aggregated, not the top ones', FEDALA_PY,
             (('for name, p in named[-self.hyper.layers:]}', 'for name, p in named}'),), FEDALA),
    Mutation('fedala: the first aggregation takes one iteration', FEDALA_PY,
             (('iterations = self.hyper.max_iterations if stage == LOCAL else 1', 'iterations = 1'),), FEDALA),
    Mutation('fedala: every aggregation iterates until settled', FEDALA_PY,
             (('iterations = self.hyper.max_iterations if stage == LOCAL else 1', 'iterations = self.hyper.max_iterations'),), FEDALA),
    Mutation('fedala: a device without a local model runs ALA against its initial model', FEDALA_PY,
             (('            self.stage = LOCAL\n            return []\n', '            self.stage = LOCAL\n'),), FEDALA),
    Mutation('fedala: deploys the global model', FEDALA_PY,
             (('if self.stage != FRESH:\n            self.adapt(', 'if self.stage == -1:\n            self.adapt('),), FEDALA),
    Mutation('fedala: a restart forgets W', FEDALA_PY,
             (('torch.as_tensor(np.array(w), device=self.device) for name', 'torch.ones_like(torch.as_tensor(np.array(w))) for name'),), FEDALA),
    Mutation('fedala: trains from the global model (no ALA in fit)', FEDALA_PY,
             (('        self.initialize_local_model(task)\n        loss = self.train_locally(task)', '        self.load_shared(task)\n        loss = self.train_locally(task)'),), FEDALA),
    Mutation("fedala: a release's body statistics overwrite theta_i", FEDALA_PY,
             (('        finally:\n            load_arrays(self.model, local)', '        finally:\n            pass'),), FEDALA),
    # FedProto: Eq. (7) with the MSE L_R, local prototypes (Eq. 3), count-weighted global prototypes (Eq. 6)
    Mutation("fedproto: prototype term without its lambda", FEDPROTO_PY,
             (("value = value + self.hyper.lam * squared.sum() / z.numel()",
               "value = value + squared.sum() / z.numel()"),), FEDPROTO),
    Mutation("fedproto: prototype term also for classes without a prototype", FEDPROTO_PY,
             (("squared = ((z - centres[yb]) ** 2).sum(dim=1) * has_prototype[yb]",
               "squared = ((z - centres[yb]) ** 2).sum(dim=1)"),), FEDPROTO),
    Mutation("fedproto: prototype term summed over the features, not averaged (MSE)", FEDPROTO_PY,
             (("squared.sum() / z.numel()", "squared.sum() / len(yb)"),), FEDPROTO),
    Mutation("fedproto: prototypes of the body in training mode", FEDPROTO_PY,
             (("with torch.no_grad(), eval_mode(self.model):", "with torch.no_grad():"),), FEDPROTO),
    Mutation("fedproto: feature sums not divided by the device's examples", FEDPROTO_PY,
             (('"feature_sums": (sums / total).astype(np.float32)', '"feature_sums": sums.astype(np.float32)'),),
             FEDPROTO),
    Mutation("fedproto: the nearest prototype deployed", FEDPROTO_PY,
             (('metrics["prototype_accuracy"] = self.prototype_accuracy(*prototypes)',
               'metrics["accuracy"] = metrics["prototype_accuracy"] = self.prototype_accuracy(*prototypes)'),),
             FEDPROTO),
    Mutation("fedproto: server weighs every device alike, not by its examples", FEDPROTO_SERVER_PY,
             (("self._sums.add(groups[PROTOTYPES], weight)", "self._sums.add(groups[PROTOTYPES], 1.0)"),), FEDPROTO),
    Mutation("fedproto: server gives a prototype to a class nobody has", FEDPROTO_SERVER_PY,
             (("has_prototype = shares > 0", "has_prototype = shares >= 0"),), FEDPROTO),
    Mutation("fedproto: server keeps classes of earlier rounds", FEDPROTO_SERVER_PY,
             (('"has_prototype": has_prototype}}',
               '"has_prototype": has_prototype | self.state[GLOBAL_PROTOTYPES]["has_prototype"]}}'),), FEDPROTO),
    Mutation("fedproto: shard partial sums not folded", FEDPROTO_SERVER_PY,
             (("self._sums.add_partial(partial[PROTOTYPES], dtypes)", "del dtypes"),), FEDPROTO),
    # Ditto: a personal model on h_k(v; w^t) anchored at the global model that came down, deployed
    Mutation("ditto: the personal model anchored at the device's updated global model", "edge_sdk/algorithms/ditto.py",
             (("        anchor = self.received_global()\n        loss = self.train_locally(task)\n",
               "        loss = self.train_locally(task)\n        anchor = self.received_global()\n"),),
             ("tests/unit/test_ditto_objective.py",)),
    Mutation("ditto: no proximal term in the personal objective", "edge_sdk/algorithms/ditto.py",
             (("return 0.5 * lam * sum(", "return 0.0 * lam * sum("),), ("tests/unit/test_ditto_objective.py",)),
    Mutation("ditto: the global model deployed", "edge_sdk/algorithms/ditto.py",
             (('return {"accuracy": self.test_accuracy(self.personal),', 'return {"accuracy": global_accuracy,'),),
             ("tests/unit/test_ditto_objective.py",)),
    Mutation("fedbn: BatchNorm layers uploaded and overwritten", "edge_sdk/algorithms/fedbn.py",
             (("share_batchnorm = False", "share_batchnorm = True"),), ("tests/unit/test_fedbn_objective.py",)),
    # FedBABU: the body trained over a fixed random head; the whole model fine-tuned for the score
    Mutation("fedbabu: head trained during federated training", "edge_sdk/algorithms/fedbabu.py",
             (("self.train_parts(self.model, BODY,", "self.train_parts(self.model, WHOLE,"),),
             ("tests/unit/test_fedbabu_objective.py",)),
    Mutation("fedbabu: head uploaded and averaged", "edge_sdk/algorithms/fedbabu.py",
             (("shared_parts = BODY", "shared_parts = WHOLE"),), ("tests/unit/test_fedbabu_objective.py",)),
    Mutation("fedbabu: scored without fine-tuning", "edge_sdk/algorithms/fedbabu.py",
             (('"accuracy": self.test_accuracy(tuned),', '"accuracy": self.test_accuracy(self.model),'),),
             ("tests/unit/test_fedbabu_objective.py",)),
    Mutation("fedbabu: head-only fine-tuning", "edge_sdk/algorithms/fedbabu.py",
             (("self.train_parts(tuned, WHOLE,", 'self.train_parts(tuned, ("head",),'),),
             ("tests/unit/test_fedbabu_objective.py",)),
    Mutation("fedbabu: the device's own model fine-tuned", "edge_sdk/algorithms/fedbabu.py",
             (("tuned = copy.deepcopy(self.model)", "tuned = self.model"),), ("tests/unit/test_fedbabu_objective.py",)),
    Mutation("fedbabu: default tau_f not the paper's", "edge_sdk/algorithms/hyper/fedbabu.py",
             (("finetune_epochs: int = 5", "finetune_epochs: int = 10"),), ("tests/unit/test_fedbabu_objective.py",)),
    # Round ends: a device that dropped off is waited for while the quorum needs it
    Mutation("rounds: a device that dropped off not waited for while the quorum needs it", SYNC_ROUNDS_PY,
             (("            rejoin=run.config.round.quorum_grace,\n", ""),),
             ("tests/unit/test_loopback_faults.py::test_a_device_back_mid_round_gets_the_open_request_again_and_counts",
              "tests/unit/test_rounds.py")),
    Mutation("rounds: the collector closes below its quorum while a dropped device may come back",
             "coordinator/rounds/collector.py",
             (("        settled = not self.waiting and not self._rejoin_pending(now)",
               "        settled = not self.waiting"),),
             ("tests/unit/test_rounds.py",)),
    # What a private or secure run publishes: counts withheld, evaluations outside a round budget-checked
    Mutation("disclosure: exact counts in HELLO under secure aggregation", "edge_sdk/privacy/disclosure.py",
             (("    if secure:\n        return {EXAMPLES_BUCKET", "    if False:\n        return {EXAMPLES_BUCKET"),),
             ("tests/unit/test_loopback_secagg.py::test_a_secure_run_reaches_the_plain_run_s_model_and_uploads_only_"
              "masked_vectors",)),
    Mutation("disclosure: the weights' scale below a device's examples", "edge_sdk/privacy/disclosure.py",
             (("math.ceil(math.log2(examples))", "math.floor(math.log2(examples))"),),
             ("tests/unit/test_loopback_secagg.py::test_a_secure_run_reaches_the_plain_run_s_model_and_uploads_only_"
              "masked_vectors",)),
    Mutation("disclosure: counts in EVAL_RES under secure aggregation", "edge_sdk/privacy/disclosure.py",
             (("if k not in COUNTS} if secure", "if k not in COUNTS} if False"),),
             ("tests/unit/test_loopback_secagg.py::test_a_secure_run_reaches_the_plain_run_s_model_and_uploads_only_"
              "masked_vectors",)),
    Mutation("live view: device counts published under DP", "coordinator/observe/live.py",
             (("            if self.private:\n                devices",
               "            if False:\n                devices"),),
             ("tests/unit/test_observe_live.py",)),
    Mutation("prometheus: round counts published under DP", "coordinator/observe/prometheus.py",
             (("isinstance(event, RoundStarted) and not self.private", "isinstance(event, RoundStarted)"),),
             ("tests/unit/test_observe.py",)),
    Mutation("weak device: what it runs said under DP", "edge_sdk/lite/client.py",
             (('config: dict[str, Any] = {"release": release.sha256}',
               'config: dict[str, Any] = {"release": release.sha256, "runs": deployed.sha256}'),),
             (f"{PRIVACY_LOOPBACK}test_a_weak_device_s_evaluation_under_dp_says_neither_what_it_runs_nor_why",)),
    Mutation("matrix: an algorithm that cannot run async let through", "coordinator/rounds/async_steps.py",
             (("(algorithm.asynchronous is not None, f", "(False, f"),),
             (f"{MATRIX}test_the_readme_async_column_agrees_with_the_matrix",)),
    Mutation("matrix: a release of a personal body let through", "coordinator/server.py",
             (("if config.run.release and not self.algorithm.shares_body():",
               "if config.run.release and False:"),),
             (f"{MATRIX}test_every_documented_refusal_is_the_coordinator_s_own",)),
    Mutation("dp: an evaluation outside a round not budget-checked", RUN_PRIVACY_PY,
             (("        after = self._epsilon_after_evaluation()\n", "        after = 0.0\n"),),
             (f"{PRIVACY_LOOPBACK}test_an_evaluation_outside_a_round_is_refused_by_name_when_it_would_exceed_the_budget",
              f"{PRIVACY_LOOPBACK}test_a_resumed_run_s_final_evaluation_is_budget_checked_and_accounted")),
    # The algorithm registry: the ids are the algorithm modules, the tables' metadata is on each class
    Mutation("registry: an infrastructure module taken for an algorithm", ALGORITHMS_INIT_PY,
             (('"part_sharing", "hyper"})', '"part_sharing"})'),), REGISTRIES),
    Mutation("registry: the tables' order not by rank", ALGORITHMS_INIT_PY,
             (("key=lambda cls: cls.table_rank", "key=lambda cls: cls.id"),), REGISTRIES),
    Mutation("registry: two algorithms share a table rank", "edge_sdk/algorithms/fedala.py",
             (("table_rank = 190", "table_rank = 180"),), REGISTRIES),
    Mutation("registry: a device class without its display name", "edge_sdk/algorithms/fedbn.py",
             (('    display_name = "FedBN"\n', ""),), REGISTRIES),
    # What the coordinator sends and what devices refuse: checked before sending, refused upward
    Mutation("warm start: a 0-d array turned 1-d", "coordinator/run/warm_start.py",
             (('np.array(given, dtype=fresh.dtype, order="C")', "np.ascontiguousarray(given, dtype=fresh.dtype)"),),
             ("tests/unit/test_warm_start.py::test_a_scalar_array_keeps_its_shape",)),
    Mutation("outgoing: a broadcast every device must refuse is sent", "coordinator/algorithms/base.py",
             (("        check_outgoing(what, groups, self.model_spec, sliced=self.sliced_broadcast)\n", "        pass\n"),),
             ("tests/unit/test_outgoing.py",)),
    Mutation("refusal: a device keeps silent about a request it cannot take", "edge_sdk/session.py",
             (("if (reply_kind is None or reason not in REPORTED_REFUSALS", "if (True or reason not in REPORTED_REFUSALS"),),
             ("tests/unit/test_device_refusals.py::test_a_round_every_device_refused_stops_the_run_with_the_reason",)),
    Mutation("refusal: a run whose every device refused plays on", "coordinator/rounds/collector.py",
             (("    if not asked or set(answered) & set(asked)", "    if True or set(answered) & set(asked)"),),
             ("tests/unit/test_device_refusals.py::test_the_stop_needs_every_device_asked_to_have_refused",)),
)


def run_tests(copy: Path, tests: tuple[str, ...], workers: int = 1) -> subprocess.CompletedProcess:
    """pytest on `tests` inside `copy`, importing the copy's code, spread over `workers` processes
    (pytest-xdist, of the `dev` extra, a file's tests together) when more than one."""
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    spread = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 and find_spec("xdist") else []
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *spread, *tests],
                          cwd=copy, env=env, capture_output=True, text=True)


def mutated(text: str, mutation: Mutation) -> str:
    """`text` with the mutation's replacements; ValueError if one does not match exactly once."""
    for old, new in mutation.replacements:
        if text.count(old) != 1:
            raise ValueError(f"{mutation.name}: {old!r} occurs {text.count(old)} times in {mutation.module}")
        text = text.replace(old, new)
    return text


def check(mutation: Mutation, copies: queue.Queue) -> bool:
    """Apply `mutation` to a free copy, run its tests there, restore it; True if they failed."""
    copy = copies.get()
    path = copy / mutation.module
    original = path.read_text()
    try:
        path.write_text(mutated(original, mutation))
        caught = run_tests(copy, mutation.tests).returncode != 0
    finally:
        path.write_text(original)
        copies.put(copy)
    print(f"{'caught  ' if caught else 'SURVIVED'} {mutation.name}", flush=True)
    return caught


def main(selected: list[str], jobs: int, baseline_passed: bool = False, changed: bool = False,
         record: bool = False) -> int:
    mutations = [m for m in MUTATIONS if not selected or any(s in m.name for s in selected)]
    if not mutations:  # else the baseline below would be the whole suite
        print(f"no mutation's name contains any of {selected}")
        return 2
    for mutation in mutations:  # every mutation still applies, before anything runs
        try:
            mutated((ROOT / mutation.module).read_text(), mutation)
        except ValueError as error:
            print(error)
            return 2
    ledger_path = ROOT / "tests" / LEDGER_NAME
    ledger = read_ledger(ledger_path)
    prints = {m.name: fingerprint(ROOT, m) for m in mutations}
    if changed:
        unchanged = [m for m in mutations if ledger.get(m.name) == prints[m.name]]
        mutations = [m for m in mutations if ledger.get(m.name) != prints[m.name]]
        print(f"{len(unchanged)} mutations skipped: caught on the same module and tests in the last full pass "
              f"({ledger_path.relative_to(ROOT)}); {len(mutations)} to run")
        if not mutations:
            return 0
    # the slow ones (whole runs of the command, over a broker) first, so none is left alone at the end
    mutations.sort(key=lambda m: not any(t.startswith(("tests/integration", "tests/e2e")) for t in m.tests))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edgepfl-mutation-") as folder:
        copies: queue.Queue = queue.Queue()
        for job in range(jobs):
            copy = Path(folder) / f"repo{job}"
            shutil.copytree(ROOT, copy, ignore=IGNORED)
            copies.put(copy)
        if not baseline_passed:
            baseline = run_tests(copies.queue[0], tuple(sorted({t for m in mutations for t in m.tests})), jobs)
            if baseline.returncode != 0:
                print(f"the unmutated tests fail:\n{baseline.stdout[-3000:]}{baseline.stderr[-2000:]}")
                return 2
        with ThreadPoolExecutor(jobs) as pool:
            caught = list(pool.map(lambda m: check(m, copies), mutations))
    survivors = [m.name for m, ok in zip(mutations, caught) if not ok]
    seconds = time.monotonic() - started
    print(f"{len(mutations) - len(survivors)} of {len(mutations)} mutations caught in {seconds:.0f} s")
    if record:  # the names no longer defined leave the ledger; a survivor's entry is dropped
        defined = {m.name for m in MUTATIONS}
        ledger = {name: value for name, value in ledger.items() if name in defined and name not in survivors}
        ledger.update({m.name: prints[m.name] for m, ok in zip(mutations, caught) if ok})
        write_ledger(ledger_path, ledger)
        print(f"recorded {len(ledger)} caught mutations in {ledger_path.relative_to(ROOT)}")
    if survivors:
        print("survived: " + "; ".join(survivors))
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="mutations run at once")
    parser.add_argument("--baseline-passed", action="store_true",
                        help="skip the unmutated run: the suite just passed on this tree (make test runs it first)")
    parser.add_argument("--changed", action="store_true",
                        help="run only the mutations not caught on this same module and tests by the last full pass")
    parser.add_argument("--record", action="store_true", help="write the caught mutations' fingerprints to the ledger")
    parser.add_argument("names", nargs="*", help="run only the mutations whose name contains one of these")
    arguments = parser.parse_args()
    sys.exit(main(arguments.names, max(1, arguments.jobs), arguments.baseline_passed, arguments.changed,
                  arguments.record))
