"""Does the DP implementation keep its claim? The accountant's epsilon against the empirical lower
bound of a privacy audit in one run (`edgepfl audit-privacy`, Steinke, Nasr and Jagielski 2023),
per DP mode (central, local, distributed) at epsilon 1, 4 and 8; and the same audit of a broken
mechanism (its noise cut tenfold, or switched off, while the accountant claims the same epsilon),
which the audit must report as a violation wherever its guesses have the power to.

Each row is one audited run (`coordinator.privacy.audit_run.run_audit`) through the project's own
mechanisms: z calibrated by `RunPrivacy` to the epsilon over the planned rounds, the devices'
`privatize`, the coordinator's `PrivateMean`, the distributed noise shares summed in the clear (what
secure aggregation reveals). Protocol: the digits task's `mlp` (26,122 parameters), 1,200 devices of
which 1,000 are canaries, every device in every round (fraction 1), 2 rounds, C = 0.1, delta 1e-5,
the other devices' changes Gaussian of norm 2C (`--updates trained`: trained for real on digits),
guesses "in" for the 250 highest scores and "out" for the 250 lowest, seed 0. Full participation
gives the audit its power: under sampling the auditor does not know which rounds a canary took part
in, and a tenth of the noise at epsilon 1 then goes unseen (`--fraction 0.5 --rounds 5`: bound 0.76
to 0.80). A row's ceiling is the largest bound its 500 guesses could give (all correct): below the
claimed epsilon the audit cannot show a violation at all (epsilon 8 needs about 9,000 correct
guesses).

    python -m benchmarks.audit                   # 21 audits: about 7 min on 2 shared cores
    python -m benchmarks.audit --quick --out /tmp/audit   # 100 devices, 2 rounds, epsilon 1: seconds

Writes audit.{json,md} (or `--name`) to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from coordinator.privacy.audit_run import AUDITED_MODES, AuditPlan, run_audit
from coordinator.privacy.audit_updates import RandomUpdates, TrainedUpdates, initial_arrays
from edge_sdk.privacy import PrivacySettings

from .flags import add_output_flags, add_run_flags
from ._machine import machine_info

EPSILONS = (1.0, 4.0, 8.0)
BROKEN = ((0.1, "noise / 10"), (0.0, "no noise"))
"""The broken mechanisms: the scale of the noise they add, and the row's name for it."""
BROKEN_EPSILONS = (1.0, 4.0)
CLIP, DELTA = 0.1, 1e-5
PROTOCOL = {"dataset": "digits", "model": "mlp", "clients": 1200, "rounds": 2, "fraction": 1.0}
QUICK = {"clients": 100, "rounds": 2, "fraction": 1.0}
CANARIES = 1000
"""The protocol's canaries (--quick: every device)."""


def audit_row(mode: str, epsilon: float, scale: float, args: argparse.Namespace, canaries: int,
              updates: Any, reference: Any) -> dict[str, Any]:
    """One audited run's figures and its wall time."""
    settings = PrivacySettings(dp=mode, dp_epsilon=epsilon, dp_clip=CLIP, dp_delta=DELTA)
    plan = AuditPlan(settings, clients=args.clients, rounds=args.rounds, fraction=args.fraction, canaries=canaries,
                     guess_in=canaries // 4, guess_out=canaries // 4, seed=args.seed)
    started = time.perf_counter()
    result = run_audit(plan, reference, updates, _noise_scale=scale)
    seconds = time.perf_counter() - started
    print(f"{mode} epsilon {epsilon:g} noise x{scale:g}: bound {result.lower_bound:.3f}, {seconds:.0f} s",
          file=sys.stderr, flush=True)  # progress
    return {**result.to_json(), "seconds": round(seconds, 2)}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| mode | mechanism | epsilon | z | accountant epsilon | lower bound (95%) | ceiling | guesses | "
             "correct | verdict | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    names = dict(BROKEN)
    for r in rows:
        mechanism = "as built" if r["noise_scale"] == 1 else names[r["noise_scale"]]
        verdict = "VIOLATION" if r["violated"] else "none found"
        lines.append(f"| {r['mode']} | {mechanism} | {r['epsilon']:g} | {r['noise_multiplier']:.3f} | "
                     f"{r['accountant_epsilon']:.3f} | {r['lower_bound']:.3f} | {r['ceiling']:.3f} | {r['guesses']} | "
                     f"{r['correct']} | {verdict} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "100 devices, all canaries, 2 rounds at fraction 1, epsilon 1", name="audit")
    add_run_flags(parser, (*PROTOCOL, "seed"), {key: None for key in PROTOCOL}, broker=False)
    parser.add_argument("--canaries", type=int, help=f"canary devices (default: {CANARIES}; --quick: every device)")
    parser.add_argument("--updates", choices=("random", "trained"), default="random",
                        help="the other devices' changes (default: random)")
    args = parser.parse_args()
    for key, value in {**PROTOCOL, **(QUICK if args.quick else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    canaries = args.canaries or (args.clients if args.quick else min(CANARIES, args.clients))
    reference = initial_arrays(args.model, args.dataset, args.seed)
    updates = TrainedUpdates(args.model, args.dataset, args.clients - canaries, args.seed) \
        if args.updates == "trained" else RandomUpdates(2 * CLIP, args.seed)
    epsilons, broken_epsilons, broken = ((1.0,), (1.0,), BROKEN[1:]) if args.quick else \
        (EPSILONS, BROKEN_EPSILONS, BROKEN)
    rows = [audit_row(mode, epsilon, 1.0, args, canaries, updates, reference)
            for mode in AUDITED_MODES for epsilon in epsilons]
    rows += [audit_row(mode, epsilon, scale, args, canaries, updates, reference)
             for mode in AUDITED_MODES for epsilon in broken_epsilons for scale, _ in broken]
    protocol = {key: getattr(args, key) for key in (*PROTOCOL, "seed", "updates")}
    protocol.update(canaries=canaries, clip=CLIP, delta=DELTA, parameters=sum(v.size for v in reference.values()))
    out, name = Path(args.out), args.name or "audit"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"protocol": protocol, "rows": rows, "machine": machine_info()},
                                                 indent=2) + "\n")
    table = markdown(rows)
    (out / f"{name}.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
