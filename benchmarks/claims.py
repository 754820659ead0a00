"""How a benchmark checks a paper's stated ordering ("A > B") on measured runs: the per-seed
differences on the seeds both sides ran, their mean and std, and a verdict. ablations.py and fair.py
share it, so that their claim tables read alike."""

from __future__ import annotations

from typing import Any

from .runs import mean_std

NOT_MEASURED = {"measured": "not measured", "reproduced": "not measured"}
"""What a claim reads where its two sides have no seed in common."""

TIE = "tie"
"""The verdict on a difference no larger than its std over seeds: neither side is ahead."""

VERDICTS = ("yes: the stated order holds; no: the reverse holds; tie: the mean difference is no larger than "
            "its std over seeds, so the seeds do not order the two; (1 seed): one seed only, no spread known")
"""The verdicts, as the tables explain them."""


def compare(better: dict[Any, float], worse: dict[Any, float]) -> dict[str, Any] | None:
    """`better` against `worse` (seed -> accuracy, a fraction), on the seeds both hold: {"seeds",
    "differences", "measured", "reproduced"}; None when no seed is common."""
    seeds = sorted(set(better) & set(worse))
    if not seeds:
        return None
    differences = [better[s] - worse[s] for s in seeds]
    spread = mean_std(differences)
    mean_of = lambda side: 100 * sum(side[s] for s in seeds) / len(seeds)  # noqa: E731
    measured = f"{mean_of(better):.2f} vs {mean_of(worse):.2f}: {100 * spread['mean']:+.2f}"
    if spread["n"] > 1:
        measured += f" ± {100 * spread['std']:.2f}"
    measured += f" (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})"
    return {"seeds": seeds, "differences": differences, "measured": measured, "reproduced": verdict(spread)}


def verdict(spread: dict[str, Any]) -> str:
    """'tie' when, over several seeds, the mean difference is no larger than its std; otherwise
    'yes' / 'no' by the sign of the mean difference, '(1 seed)' added when one seed is all there is."""
    if spread["n"] > 1 and abs(spread["mean"]) <= spread["std"]:
        return TIE
    answer = "yes" if spread["mean"] > 0 else "no"
    return answer + (" (1 seed)" if spread["n"] == 1 else "")
