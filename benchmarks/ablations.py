"""The five seed papers' main ablations on the accuracy protocol, and a table of the papers' claims.

Each paper's ablation is a list of rows (`ROWS`): the full method, its ablated variants as
hyperparameter overrides (`--set` values; the switches are documented in docs/ALGORITHMS.md's
ablation table) or another number of local epochs, and FedAvg and FedAvg+FT as references, all in that
paper's data setting (`SETTINGS`: Dirichlet 0.1 for RepPer and DC-PFL, whose papers use label
skew; `domains` feature skew for DualFed, CD2-pFed and FediOS, whose papers claim their gains
there; C=0.2; `--setting PAPER=SETTING` changes one). The protocol is accuracy.py's: Fashion-MNIST,
20 devices, 15 rounds x 1 local epoch, batch 32, lr 0.05, over MQTT; runs are cached by their
settings' fingerprint in the same cache, so accuracy.py's runs of the same settings are reused
(pass `--cache` to share another folder), and recorded in the committed run ledger (`--ledger`),
which serves the tables where the cache is absent. Devices are evaluated every round unless
`--eval-every N` says otherwise (the tables read the last round; every N rounds makes the FedAvg+FT
references, which fine-tune every device at each evaluation, several times cheaper; a run's
evaluation period is in its cache name, so the ledger's runs, evaluated every round, are read only
with the default).

A row that no hyperparameter expresses yet carries `missing` (why) and is never run. `CLAIMS`
lists each ordering a paper states ("with CD > without CD"); the claim table compares the two
rows' mean personalized accuracy on the seeds both ran: "tie" when the mean difference is no larger
than its std over seeds (the seeds do not order the two rows), else "yes" when the stated order
holds and "no" otherwise, and "not measured" when a row has no run.

    python -m benchmarks.ablations --papers repper,dualfed,dc_pfl --seeds 0 --cache /work/runs/cache
    python -m benchmarks.ablations --cached-only --cache /work/runs/cache   # tables from what is cached

Quick smoke run (digits, 2 rounds, 6 devices, DualFed's rows and FedAvg, one setting, seed 0):

    python -m benchmarks.ablations --quick --out /tmp/abl

Writes ablations-<dataset>-<rounds>rounds.{json,md} (or `--name`) to --out.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from .claims import NOT_MEASURED, VERDICTS, compare
from .flags import (
    PROTOCOL,
    RUN_SETTINGS,
    add_cache_flags,
    add_output_flags,
    add_run_flags,
    add_seeds_flag,
    finish_cache_flags,
    run_settings,
)
from ._machine import machine_info
from .runs import (NAMES, PAPER_METHODS, RunCache, RunPool, Setting, bench_config, listed, mean_std, setup_logging,
                    trailer, write_outputs)

log = logging.getLogger("benchmarks")

PAPERS = PAPER_METHODS
"""The five papers whose ablations and claims this script measures (`paper_method` of their device classes)."""
SETTINGS = {"repper": "dir0.1@0.2", "dc_pfl": "dir0.1@0.2", "dualfed": "domains@0.2", "cd2_pfed": "domains@0.2",
            "fedios": "domains@0.2"}
"""Each paper's data setting: label skew where the paper evaluates label skew, feature skew where it claims it."""
FULL = "full"
"""The id of each paper's full method: its defaults, but FediOS's, whose L_re is taken on the extractors'
outputs (`l_re=extractors`, lam 0.1): the printed L_re, the default, is identically 0, so FediOS's full
method as printed is its "w/o L_re" row."""
RUN_FLAGS = (*RUN_SETTINGS, "eval_every")
"""The run settings this script takes as flags (`edgepfl simulate`'s)."""


@dataclass(frozen=True)
class Row:
    """One line of a paper's ablation: `algorithm` with `overrides` (hyperparameter -> --set value)
    and `local_epochs` (None: the run's). `missing`: why no hyperparameter expresses it yet."""

    paper: str
    id: str
    label: str
    algorithm: str
    overrides: dict[str, str] = field(default_factory=dict)
    local_epochs: int | None = None
    missing: str = ""


def references(paper: str) -> list[Row]:
    return [Row(paper, "fedavg", "FedAvg (reference)", "fedavg"),
            Row(paper, "fedavg_ft", "FedAvg+FT (reference)", "fedavg_ft")]


ROWS: list[Row] = [
    Row("repper", FULL, "RepPer (default: L_out)", "repper"),
    Row("repper", "l_in", "RepPer, L_in (Eq. 5 as printed)", "repper", {"variant": "in"}),
    Row("repper", "e2", "RepPer, 2 local epochs", "repper", local_epochs=2),
    *references("repper"),
    Row("dualfed", FULL, "DualFed (stage-wise)", "dualfed"),
    Row("dualfed", "simultaneous", "DualFed, simultaneous", "dualfed", {"schedule": "simultaneous"}),
    Row("dualfed", "no_projector", "DualFed without projector", "dualfed", {"projector": "false"}),
    Row("dualfed", "e2", "DualFed (stage-wise), 2 local epochs", "dualfed", local_epochs=2),
    Row("dualfed", "simultaneous_e2", "DualFed, simultaneous, 2 local epochs", "dualfed",
        {"schedule": "simultaneous"}, local_epochs=2),
    *references("dualfed"),
    Row("dc_pfl", FULL, "DC-PFL", "dc_pfl"),
    Row("dc_pfl", "no_al", "DC-PFL w/o AL (lam=0)", "dc_pfl", {"lam": "0"}),
    Row("dc_pfl", "no_gc", "DC-PFL w/o GC (calibration_epochs=0)", "dc_pfl", {"calibration_epochs": "0"}),
    *references("dc_pfl"),
    Row("cd2_pfed", FULL, "CD2-pFed (LI + TA + CD)", "cd2_pfed"),
    Row("cd2_pfed", "no_cd", "CD2-pFed w/o CD (lam=0)", "cd2_pfed", {"lam": "0"}),
    Row("cd2_pfed", "no_ta", "CD2-pFed w/o TA (beta=1, warmup=0: no EMA)", "cd2_pfed", {"beta": "1", "warmup": "0"}),
    Row("cd2_pfed", "no_li", "CD2-pFed w/o LI (ramp=false: p_t = p from round 1)", "cd2_pfed", {"ramp": "false"}),
    *references("cd2_pfed"),
    Row("fedios", FULL, "FediOS (L_re on extractors, lam 0.1; alpha 0.5)", "fedios", {"l_re": "extractors"}),
    Row("fedios", "no_lre", "FediOS w/o L_re (lam=0): the printed form, the default", "fedios", {"lam": "0"}),
    Row("fedios", "no_personal", "FediOS w/o personal extractor (CE on phi_g alone)", "fedios",
        {"personal_extractor": "false"}),
    *(Row("fedios", f"alpha{a}", f"FediOS (L_re on extractors, lam 0.1), alpha {a}", "fedios",
          {"l_re": "extractors", "alpha": a}) for a in ("0.1", "0.3", "0.7", "0.9")),
    *references("fedios"),
]

QUICK_ROWS = {("dualfed", i) for i in (FULL, "simultaneous", "no_projector", "fedavg")}


@dataclass(frozen=True)
class Claim:
    """A paper's stated ordering: row `better` beats row `worse` (ids within `paper`)."""

    paper: str
    text: str
    better: str
    worse: str
    source: str


CLAIMS: list[Claim] = [
    Claim("repper", "L_out > L_in", FULL, "l_in",
          "no ordering in the paper (Eq. 5 is L_in); the reason for the default (Khosla et al.)"),
    Claim("repper", "more local epochs > fewer (E 2 > 1)", "e2", FULL, "Sec. 'Effect of E', Table 1 (E 20 > 10)"),
    Claim("repper", "RepPer > FedAvg+FT", FULL, "fedavg_ft", "Table 2"),
    Claim("repper", "RepPer > FedAvg", FULL, "fedavg", "Table 2"),
    Claim("dualfed", "E=1: simultaneous > stage-wise", "simultaneous", FULL, "Table 4 (E=1)"),
    Claim("dualfed", "more epochs: stage-wise > simultaneous (E 2 here, 20 in the paper)", "e2", "simultaneous_e2",
          "Table 4 (E=20, PACS and DomainNet)"),
    Claim("dualfed", "with projector > without", FULL, "no_projector",
          "Table 7 / Sec. 5.3 (a personal projector on the shared encoder; no row without it)"),
    Claim("dualfed", "DualFed > FedAvg", FULL, "fedavg", "Tables 1-2"),
    Claim("dc_pfl", "DC-PFL > w/o AL", FULL, "no_al", "Table 1"),
    Claim("dc_pfl", "DC-PFL > w/o GC", FULL, "no_gc", "Table 1"),
    Claim("dc_pfl", "w/o AL > w/o GC", "no_al", "no_gc", "Table 1 ('in most cases')"),
    Claim("dc_pfl", "DC-PFL > FedAvg", FULL, "fedavg", "Table 1"),
    Claim("cd2_pfed", "with CD > without CD", FULL, "no_cd", "Table 5"),
    Claim("cd2_pfed", "with TA (EMA) > without", FULL, "no_ta", "Table 5"),
    Claim("cd2_pfed", "with LI (ratio ramp) > without", FULL, "no_li", "Table 5"),
    Claim("cd2_pfed", "CD matters more than TA: w/o TA > w/o CD", "no_ta", "no_cd", "Table 5, Sec. 4.5"),
    Claim("cd2_pfed", "CD2-pFed > FedAvg", FULL, "fedavg", "Tables 1-3"),
    Claim("fedios", "with L_re (on extractors) > without", FULL, "no_lre", "Table 7"),
    Claim("fedios", "with personal extractor > without", FULL, "no_personal", "Table 7"),
    Claim("fedios", "w/o personal extractor > FedAvg ('slightly')", "no_personal", "fedavg", "Table 7, Sec. 4.4"),
    Claim("fedios", "w/o L_re > w/o personal extractor", "no_lre", "no_personal", "Table 7"),
    Claim("fedios", "alpha 0.5 > alpha 0.1", FULL, "alpha0.1", "Fig. 5 (optimum around 0.5)"),
    Claim("fedios", "alpha 0.5 > alpha 0.9", FULL, "alpha0.9", "Fig. 5 (optimum around 0.5)"),
    Claim("fedios", "FediOS (L_re on extractors) > FedAvg", FULL, "fedavg", "Tables 2-4"),
]


# -- arguments -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "digits, 6 devices, 2 rounds, DualFed's full/simultaneous/no-projector rows and FedAvg, "
                             "dir0.5@1, seed 0", name="ablations-<dataset>-<rounds>rounds")
    add_cache_flags(parser, "other rows 'not run'", jobs=True)
    parser.add_argument("--papers", default=",".join(PAPERS))
    parser.add_argument("--rows", help="only these row ids (e.g. full,l_in,fedavg), in every paper asked for")
    parser.add_argument("--setting", action="append", default=[], metavar="PAPER=SETTING",
                        help="a paper's data setting, e.g. dualfed=dir0.1@0.2 (repeatable)")
    add_seeds_flag(parser, "0")
    add_run_flags(parser, RUN_FLAGS, {**PROTOCOL, "rounds": 15})
    args = parser.parse_args(argv)
    args.settings = dict(SETTINGS)
    if args.quick:
        args.dataset, args.clients, args.rounds, args.seeds, args.papers = "digits", 6, 2, "0", "dualfed"
        args.settings = {paper: "dir0.5@1" for paper in PAPERS}
    for text in args.setting:
        paper, equals, setting = text.partition("=")
        if not equals or paper not in PAPERS:
            raise SystemExit(f"--setting {text!r}: expected PAPER=SETTING with PAPER one of {', '.join(PAPERS)}")
        try:
            Setting.parse(setting)
        except ValueError as exc:
            raise SystemExit(f"--setting {text!r}: {exc}") from None
        args.settings[paper] = setting
    args.papers = listed(args.papers)
    unknown = [p for p in args.papers if p not in PAPERS]
    if unknown:
        raise SystemExit(f"--papers: unknown {', '.join(unknown)}; known: {', '.join(PAPERS)}")
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
    if args.eval_every < 1:
        raise SystemExit(f"--eval-every must be at least 1, got {args.eval_every}")
    args.seeds = [int(s) for s in listed(args.seeds)]
    finish_cache_flags(args)
    run_settings(args, RUN_FLAGS)  # a value the run configuration refuses exits here, naming its key
    args.name = args.name or f"ablations-{args.dataset}-{args.rounds}rounds"
    return args


def selected_rows(args: argparse.Namespace) -> list[Row]:
    """The rows of the papers asked for (and of --rows, or the quick run's), their overrides checked."""
    from coordinator.algorithms import hyperparameters

    rows = [r for r in ROWS if r.paper in args.papers]
    if args.quick:
        rows = [r for r in rows if (r.paper, r.id) in QUICK_ROWS]
    if args.rows:
        wanted = set(listed(args.rows))
        known = {r.id for r in rows}
        if wanted - known:
            raise SystemExit(f"--rows: unknown {', '.join(sorted(wanted - known))}; known: {', '.join(sorted(known))}")
        rows = [r for r in rows if r.id in wanted]
    for row in rows:
        hyperparameters(row.algorithm, row.overrides)  # a bad override names its key before any training
    return rows


def run_config(args: argparse.Namespace, row: Row, seed: int):
    setting = Setting.parse(args.settings[row.paper])
    fields = {**run_settings(args, RUN_FLAGS), "local_epochs": row.local_epochs or args.local_epochs}
    return bench_config(algorithm=row.algorithm, seed=seed, hyper=dict(row.overrides), **fields, **setting.fields())


# -- runs -------------------------------------------------------------------------------------
def run_rows(args: argparse.Namespace, cache: RunCache, rows: list[Row]) -> list[dict[str, Any]]:
    """One result per row: its accuracy on every seed that ran (a row without a switch is not run)."""
    results = []
    for number, row in enumerate(rows, 1):
        result = {"paper": row.paper, "id": row.id, "label": row.label, "algorithm": row.algorithm,
                  "overrides": row.overrides, "local_epochs": row.local_epochs or args.local_epochs,
                  "setting": args.settings[row.paper], "missing": row.missing, "seeds": {}, "global_accuracy": {},
                  "runs": {}, "machines": {}}
        for seed in [] if row.missing else args.seeds:
            view = cache.run(run_config(args, row, seed))
            if view is None:
                log.info("[%d/%d] %s %s seed %d: %s", number, len(rows), row.paper, row.id, seed,
                         "not in cache" if cache.cached_only else "failed")
                continue
            result["seeds"][seed] = view.personalized()["mean"]
            result["global_accuracy"][seed] = view.global_accuracy()
            result["runs"][seed] = view.out.name
            result["machines"][seed] = view.machine()
            log.info("[%d/%d] %s %s seed %d: %.4f%s", number, len(rows), row.paper, row.id, seed,
                     result["seeds"][seed], " (cached)" if view.cached else f" ({view.seconds:.0f} s)")
        result["accuracy"] = mean_std(list(result["seeds"].values()))
        results.append(result)
    return results


# -- claims -----------------------------------------------------------------------------------
def claim_rows(results: list[dict[str, Any]], claims: list[Claim] = CLAIMS) -> list[dict[str, Any]]:
    """Each claim of a paper whose rows were asked for, measured on the seeds both of its rows ran."""
    by_id = {(r["paper"], r["id"]): r for r in results}
    table = []
    for claim in claims:
        better, worse = by_id.get((claim.paper, claim.better)), by_id.get((claim.paper, claim.worse))
        if better is None and worse is None:
            continue
        entry = {"paper": claim.paper, "claim": claim.text, "source": claim.source, "better": claim.better,
                 "worse": claim.worse, "seeds": [], "differences": [], **NOT_MEASURED}
        comparison = compare(better["seeds"] if better else {}, worse["seeds"] if worse else {})
        if comparison:
            entry.update(comparison)
        else:
            absent = [row for row in (better, worse) if row is None or not row["seeds"]]
            why = "; ".join(row["missing"] for row in absent if row and row["missing"])
            entry["measured"] = f"not measured ({why})" if why else "not measured"
        table.append(entry)
    return table


# -- outputs ------------------------------------------------------------------------------------
def pct_cell(cell: dict[str, Any]) -> str:
    if cell["mean"] is None:
        return "-"
    return f"{100 * cell['mean']:.2f}" + (f" ± {100 * cell['std']:.2f}" if cell["n"] > 1 else "")


def override_text(result: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in result["overrides"].items()) or "defaults"


def evaluation_text(eval_every: int) -> str:
    """The header's note on how often devices were evaluated: nothing for every round (the default)."""
    return "" if eval_every == 1 else f"Devices evaluated every {eval_every} rounds and after the last. "


def markdown(args: argparse.Namespace, document: dict[str, Any]) -> str:
    config, results = document["config"], document["rows"]
    lines = ["## Ablations of the five seed papers", "",
             f"{config['dataset']}, {config['clients']} devices, **{config['rounds']} rounds**, batch "
             f"{config['batch_size']}, lr {config['lr']}, each paper in its setting; mean personalized accuracy over "
             "devices at the last round (%), mean ± std over the seeds named; 'vs full': points over the paper's full "
             f"method on the seeds both ran. {evaluation_text(config['eval_every'])}Over MQTT.", ""]
    for paper in config["papers"]:
        rows = [r for r in results if r["paper"] == paper]
        full = next((r for r in rows if r["id"] == FULL), None)
        setting = Setting.parse(config["settings"][paper])
        lines += [f"### {NAMES[paper]} ({setting.label})", "",
                  "| row | algorithm, overrides | E | accuracy | seeds | vs full | global accuracy |",
                  "|---|---|---|---|---|---|---|"]
        for row in rows:
            seeds = sorted(row["seeds"])
            common = [s for s in seeds if full and s in full["seeds"]]
            versus = ("-" if full is None or row is full or not common else
                      f"{100 * sum(row['seeds'][s] - full['seeds'][s] for s in common) / len(common):+.2f}")
            globals_ = [v for v in row["global_accuracy"].values() if v is not None]
            accuracy = pct_cell(row["accuracy"]) if seeds else (f"not run: {row['missing']}" if row["missing"]
                                                                 else "not run")
            lines.append(f"| {row['label']} | {NAMES[row['algorithm']]}, {override_text(row)} | {row['local_epochs']} "
                         f"| {accuracy} | {', '.join(map(str, seeds)) or '-'} | {versus} | "
                         f"{pct_cell(mean_std(globals_)) if globals_ else '-'} |")
        lines.append("")
    lines += ["### The papers' claims", "",
              "Each ordering a paper states, measured on the seeds both rows ran (difference in points, ± its std "
              f"over seeds). Verdicts: {VERDICTS}.", "",
              "| paper | claim | source | measured here | reproduced? |", "|---|---|---|---|---|"]
    for claim in document["claims"]:
        lines.append(f"| {NAMES[claim['paper']]} | {claim['claim']} | {claim['source']} | {claim['measured']} | "
                     f"{claim['reproduced']} |")
    lines += trailer(document, [where for row in results for where in row.get("machines", {}).values()])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    rows = selected_rows(args)
    cache = RunCache(args.cache, broker=args.broker, cached_only=args.cached_only, ledger=args.ledger)
    machine = machine_info()
    if args.jobs > 1 and not args.cached_only:  # side by side first; run_rows then reads them from the cache
        pool = RunPool(cache, args.jobs)
        for row in rows:
            for seed in [] if row.missing else args.seeds:
                pool.submit(run_config(args, row, seed))
        pool.run_all()
    results = run_rows(args, cache, rows)
    config = {"dataset": args.dataset, "clients": args.clients, "rounds": args.rounds,
              "local_epochs": args.local_epochs, "batch_size": args.batch_size, "lr": args.lr, "seeds": args.seeds,
              "papers": args.papers,
              "settings": {p: args.settings[p] for p in args.papers}, "eval_every": args.eval_every,
              "workers": args.workers, "jobs": args.jobs,
              "aggregation_dtype": args.aggregation_dtype,
              "broker": args.broker or "embedded amqtt", "cache": args.cache,
              "ledger": args.ledger, "quick": args.quick}
    document = {"benchmark": "ablations", "machine": machine, "config": config, "rows": results,
                "claims": claim_rows(results), "failures": cache.failures}
    write_outputs(Path(args.out), args.name, document, markdown(args, document))
    log.info("wrote %s", Path(args.out) / f"{args.name}.md")
    if cache.failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
