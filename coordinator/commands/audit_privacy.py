"""The `edgepfl audit-privacy` subcommand: audit a DP configuration with canary devices in one
simulated run (`coordinator.privacy.audit_run`) and print the empirical lower bound on epsilon
beside the accountant's.

The DP flags are the run's own (`--dp`, `--dp-clip`, `--dp-epsilon`, `--dp-delta`, `--dp-noise`,
`--dp-accountant`, `--dp-sampling`: the `[privacy]` declarations), so z is calibrated exactly as a
run with the same flags calibrates it. The exit code is 0 when the bound stays at or below the
accountant's epsilon, 1 when it exceeds it (the implementation does not keep its claim).

The environment variable EDGEPFL_TEST_AUDIT_NOISE_SCALE scales the mechanism's noise (0.1: a
tenth, 0: none) while the accountant keeps its claim: the tests' way to check that the command
reports a broken mechanism. The output row shows the scale whenever it is not 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.flags import add_setting_flags, section_from

if TYPE_CHECKING:
    from ..privacy.audit_run import AuditResult

NOISE_SCALE_VARIABLE = "EDGEPFL_TEST_AUDIT_NOISE_SCALE"
UPDATES = ("random", "trained")
UNAUDITED = ("dp_adaptive_clip", "dp_clip_quantile", "dp_clip_lr", "dp_clip_count_noise", "dp_evaluation",
             "dp_eval_noise", "dp_reproducible_noise", "dp_sgd", "dp_sgd_noise", "dp_sgd_clip", "dp_sgd_delta")
"""The `[privacy]` settings the audit does not take: what it does not audit, and its noise is
always drawn from the seed (so the same command repeats its figures)."""
COLUMNS = ("mode", "epsilon", "delta", "z", "accountant epsilon", "lower bound (95%)", "canaries", "guesses",
           "correct")


def add_audit_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("audit-privacy", help="audit a DP configuration in one simulated run with canary "
                                                  "devices: the empirical epsilon lower bound at 95%% confidence "
                                                  "beside the accountant's")
    parser.add_argument("--clients", type=int, default=1000, help="devices in the fleet, canaries included "
                                                                  "(default: 1000)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds the accountant plans for (default: 10)")
    parser.add_argument("--fraction", type=float, default=0.5, help="fraction of devices selected per round "
                                                                    "(default: 0.5)")
    parser.add_argument("--canaries", type=int, help="canary devices among --clients, each in with probability 1/2 "
                                                     "(default: half the clients)")
    parser.add_argument("--guess-in", type=int, help="canaries of highest score guessed in (default: a quarter of "
                                                     "the canaries)")
    parser.add_argument("--guess-out", type=int, help="canaries of lowest score guessed out (default: a quarter of "
                                                      "the canaries)")
    parser.add_argument("--model", default="auto", help="the model whose arrays are audited: a built-in name or "
                                                        "package.module:factory (default: auto, the task's)")
    parser.add_argument("--dataset", default="digits", help="the built-in task the model is built for (and "
                                                            "trained on, --updates trained; default: digits)")
    parser.add_argument("--updates", choices=UPDATES, default="random",
                        help="the other devices' changes: random Gaussian directions of norm 2 x --dp-clip, or "
                             "trained for real on their part of --dataset, one local epoch (default: random)")
    parser.add_argument("--seed", type=int, default=0, help="canaries, selection and noise (default: 0)")
    parser.add_argument("--out", metavar="FILE", help="also write the result as JSON to FILE (default: none)")
    add_setting_flags(parser, "simulate", sections=("privacy",), leave_out=UNAUDITED)
    parser.set_defaults(handler=cmd_audit_privacy)


def _noise_scale() -> float:
    text = os.environ.get(NOISE_SCALE_VARIABLE)
    if text is None:
        return 1.0
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{NOISE_SCALE_VARIABLE} must be a number, got {text!r}") from None


def table(results: list[AuditResult]) -> str:
    """The results as a Markdown table, one row per audit (epsilon none: z was given, not calibrated)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        mode = r.mode if r.noise_scale == 1 else f"{r.mode} (noise x{r.noise_scale:g})"
        target = f"{r.epsilon:g}" if r.epsilon else "none"
        lines.append(f"| {mode} | {target} | {r.delta:.3g} | {r.noise_multiplier:.4g} | "
                     f"{r.accountant_epsilon:.3f} | {r.lower_bound:.3f} | {r.canaries} | {r.guesses} | {r.correct} |")
    return "\n".join(lines)


def verdict(result: AuditResult) -> str:
    """One line: whether the audit found the implementation violating its claim."""
    figures = (f"empirical lower bound {result.lower_bound:.3f} against the accountant's epsilon "
               f"{result.accountant_epsilon:.3f} at delta {result.delta:.3g}")
    if result.violated:
        return f"VIOLATION: {figures}: the DP implementation does not keep its claim (95% confidence)"
    return (f"no violation found: {figures} (these guesses could show at most {result.ceiling:.3f}; a bound below "
            "the claim does not prove it)")


def cmd_audit_privacy(args: argparse.Namespace) -> int:
    from edge_sdk.privacy import PrivacySettings

    from ..privacy.audit_run import AuditPlan

    settings = section_from(PrivacySettings, args)
    canaries = args.canaries if args.canaries is not None else max(1, args.clients // 2)
    quarter = max(1, canaries // 4)
    plan = AuditPlan(settings, clients=args.clients, rounds=args.rounds, fraction=args.fraction, canaries=canaries,
                     guess_in=quarter if args.guess_in is None else args.guess_in,
                     guess_out=quarter if args.guess_out is None else args.guess_out, seed=args.seed)
    scale = _noise_scale()
    from ..privacy.audit_run import run_audit  # torch and the model: once the flags are checked
    from ..privacy.audit_updates import RandomUpdates, TrainedUpdates, UpdateSource, initial_arrays

    updates: UpdateSource
    if args.updates == "trained":
        trained = TrainedUpdates(args.model, args.dataset, args.clients - canaries, args.seed)
        reference, updates = trained.initial(), trained
    else:
        reference = initial_arrays(args.model, args.dataset, args.seed)
        updates = RandomUpdates(2 * settings.dp_clip, args.seed)
    result = run_audit(plan, reference, updates, _noise_scale=scale)
    if args.out:
        record = {"plan": {"clients": plan.clients, "rounds": plan.rounds, "fraction": plan.fraction,
                           "model": args.model, "dataset": args.dataset, "updates": args.updates,
                           "seed": plan.seed, "accountant": settings.dp_accountant, "sampling": settings.dp_sampling,
                           "clip": settings.dp_clip},
                  "result": result.to_json()}
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    sys.stdout.write(table([result]) + "\n" + verdict(result) + "\n")  # the command's output, not a log line
    return 1 if result.violated else 0
