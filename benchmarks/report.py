"""Render the benchmark tables of ``docs/benchmarks.md`` from ``benchmarks/results/*.json`` (``make report``).

    python benchmarks/report.py            # rewrite the block between the markers in docs/benchmarks.md
    python benchmarks/report.py --check    # exit 1 if the block or a cited number differs from the JSONs
    python benchmarks/report.py --stale    # list results measured on code that differs from HEAD's
    python benchmarks/report.py --refresh docs/elastic.md   # rewrite the numbers cited there from the JSONs


The block between ``<!-- results:begin -->`` and ``<!-- results:end -->`` is replaced; the prose around it is
left alone. Every number in it carries its source right after it, as an HTML comment that Markdown hides:
``0.956<!-- results:dp_overhead.json:throughput_ratio -->`` (:func:`cite`), the key a dotted path into the
JSON (list items by index). ``tests/test_docs_numbers.py`` checks the block against this script and every
cited number in README.md and docs/*.md against its JSON (:func:`check_citations`), so a typed number
cannot go stale: to quote a figure in prose, copy it with its comment.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._staleness import stale_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
CITATION = re.compile(r"(?P<num>-?\d[\d,]*(?:\.\d+)?)(?P<suffix>[M%]?)<!-- results:(?P<file>[\w.-]+\.json):"
                      r"(?P<key>[^ >]+) -->")
"""A cited number: digits (commas allowed), an optional ``M`` (millions) or ``%`` suffix, then its comment."""

# (label, file, key, paired-summary key or None, goal text, decimals, suffix)
ROWS = [
    ("Whale vs DDP throughput (data parallel, 2 ranks)", "dp_overhead.json", "throughput_ratio",
     "throughput_ratio_paired", ">= 0.97", 3, ""),
    ("Whale ZeRO-3 vs FSDP2 throughput (4 ranks)", "zero3.json", "zero3_vs_fsdp2_throughput",
     "zero3_vs_fsdp2_throughput_paired", ">= 0.95", 3, ""),
    ("Whale ZeRO-3 vs FSDP2 peak memory (max rank)", "zero3.json", "zero3_vs_fsdp2_peak_memory", None, "<= 1.05", 3,
     ""),
    *[("Whale vs torch pipelining, {schedule}, d = {dim}", "vs_torch_pipelining.json",
       f"results.{i}.throughput_ratio_vs_torch_pipelining", f"results.{i}.paired", ">= 1.0", 3, "") for i in range(8)],
    ("Kill/resume runs (kill after a step, during a save, after the final checkpoint)", "reliability.json",
     "kill_resume_runs", None, ">= 20", 0, ""),
    ("Kill/resume runs that failed", "reliability.json", "kill_resume_failures", None, "0", 0, ""),
    ("Kill/resume: max abs. loss diff vs an uninterrupted run", "reliability.json", "kill_resume_max_loss_diff",
     None, "<= 1e-6", 1, ""),
    ("Corrupt latest checkpoint: fallbacks that loaded the previous one (of 9 tried)", "reliability.json",
     "corrupt_latest_fallbacks_ok", None, "all", 0, ""),
    ("Injected failures whose first error was named (of 12)", "reliability.json", "first_error_named_ok", None,
     "all", 0, ""),
    ("Hung rank detected, seconds (collective timeout 5 s)", "reliability.json", "hang_detect_seconds", None,
     "<= 10", 2, ""),
    *[(f"Checkpoint {what} GB/s at {n} ranks", "reliability.json", f"{what}_gb_per_s.{n}", None, "", 3, "")
      for what in ("save", "load") for n in ("2", "4")],
    *[(f"Busiest rank's share of checkpoint bytes at {n} ranks", "reliability.json",
       f"busiest_rank_bytes_share.{n}", None, f"<= {1.5 / int(n):.3f}", 3, "") for n in ("2", "4")],
    ("Elastic: node loss to first step on the new plan, median seconds (EMULATED)", "elastic.json",
     "node_loss_recovery_seconds.median", None, "< 30", 1, ""),
    ("Elastic: node loss to first step on the new plan, max seconds", "elastic.json",
     "node_loss_recovery_seconds.max", None, "< 30", 1, ""),
    ("Elastic: node-loss runs", "elastic.json", "node_loss_recovery_seconds.n", None, ">= 5", 0, ""),
    ("Elastic: of them, killed during a checkpoint save", "elastic.json", "kills_during_save", None, ">= 1", 0, ""),
    ("Elastic: steps lost, max (checkpoint every 4)", "elastic.json", "steps_lost.max", None, "<= 4", 0, ""),
    ("Elastic: loss max abs. diff vs the no-failure reference", "elastic.json", "loss_max_abs_diff_vs_reference",
     None, "<= 1e-6", 1, ""),
    ("Elastic: node joins, its agent's start to the first world-4 step, median seconds (EMULATED)", "elastic.json",
     "rejoin_recovery_seconds.median", None, "", 1, ""),
    ("Elastic: node joins, max seconds", "elastic.json", "rejoin_recovery_seconds.max", None, "", 1, ""),
    ("Elastic: node-join runs", "elastic.json", "rejoin_recovery_seconds.n", None, ">= 5", 0, ""),
    ("Elastic: node joins, steps lost, max", "elastic.json", "rejoin_steps_lost.max", None, "0", 0, ""),
    ("Elastic: node joins, loss max abs. diff vs the reference", "elastic.json",
     "rejoin_loss_max_abs_diff_vs_reference", None, "<= 1e-6", 1, ""),
    ("Stragglers: throughput after re-balance over before, one device 4x slower (EMULATED)", "straggler.json",
     "straggler_speedup", "straggler_speedup_paired", "> 1.0", 3, ""),
    ("Stragglers: the planner's predicted speedup, median", "straggler.json", "predicted_speedup", None, "", 3, ""),
    ("Stragglers: measured over predicted speedup, median of runs", "straggler.json", "measured_over_predicted", None,
     "", 3, ""),
    ("Megatron-LM SC'21 Table 1, predicted vs published TFLOP/s per GPU: median abs. rel. error", "published.json",
     "published_median_abs_rel_error", None, "<= 0.10", 3, ""),
    ("Megatron-LM SC'21 Table 1: max abs. rel. error", "published.json", "published_max_abs_rel_error", None,
     "<= 0.20", 3, ""),
    ("Megatron-LM SC'21 Table 1: auto plan vs published plan, predicted (lowest row)", "published.json",
     "auto_vs_published_predicted_min", None, ">= 1.0", 3, ""),
    ("Megatron-LM SC'21 Table 1: auto search seconds (slowest row)", "published.json", "auto_seconds_max", None,
     "< 60", 1, ""),
    ("Step-time estimator vs event simulator, max rel. gap", "published.json", "estimator_vs_simulator_max_rel_gap",
     None, "<= 0.02", 4, ""),
    *[(f"Mixed-GPU data parallel {k}, aware vs equal shares (EMULATED)", "heterogeneous.json",
       f"dp_speedup_over_equal.{k}", f"dp.{k}.speedup_over_equal_paired", ">= 0.9 x ideal", 3, "")
      for k in ("dp2", "dp4")],
    *[(f"Mixed-GPU data parallel {k}, vs ideal (EMULATED)", "heterogeneous.json", f"dp_ratio_to_ideal.{k}", None,
       ">= 0.95", 3, "") for k in ("dp2", "dp4")],
    *[(f"Mixed-GPU pipeline {k}, aware vs uniform cuts (EMULATED)", "heterogeneous.json",
       f"pp_speedup_over_uniform.{k}", f"pp.{k}.analysis.measured_speedup_paired", ">= 0.9 x ideal", 3, "")
      for k in ("pp2", "pp4")],
    ("Auto plan vs best enumerated plan (EMULATED)", "planner.json", "auto_vs_best_enumerated",
     "auto_vs_best_enumerated_paired", ">= 0.95", 3, ""),
    ("Simulator, held-out runs, declared speeds: median abs. rel. error", "planner.json",
     "sim_heldout_median_abs_rel_error", None, "<= 0.10", 3, ""),
    ("Simulator, held-out runs, declared speeds: max abs. rel. error", "planner.json", "sim_heldout_max_abs_rel_error",
     None, "<= 0.20", 3, ""),
    ("Simulator, tuning runs (the first held-out set, tuned on), declared speeds: median", "planner.json",
     "sim_tuning_median_abs_rel_error", None, "(tuned on)", 3, ""),
    ("Simulator, tuning runs (the first held-out set, tuned on), declared speeds: max", "planner.json",
     "sim_tuning_max_abs_rel_error", None, "(tuned on)", 3, ""),
    ("Simulator, declared speeds, the 13 development runs: median", "planner.json",
     "sim_nominal_median_abs_rel_error", None, "(not held out)", 3, ""),
    ("Planning 512 GPUs, seconds", "planner.json", "plan_seconds_512_gpus", None, "< 60", 2, ""),
    ("Planning 1024 mixed GPUs, seconds", "planner.json", "plan_seconds_1024_mixed", None, "< 30", 2, ""),
    ("Whale paper's 10T M6 MoE on 512 V100-32GB plans (fp16, expert parallel, offload); not without offload",
     "paper_10t.json", "paper_10t_fits", None, "true", 0, ""),
    ("10T M6: predicted step seconds (1024 sequences)", "paper_10t.json", "paper_10t.predicted_step_seconds", None,
     "", 1, ""),
    ("10T M6: peak bytes on the fullest V100-32GB", "paper_10t.json", "paper_10t.device_bytes", None,
     "<= 32e9", 0, ""),
    ("10T M6: host bytes per node (3e12 declared)", "paper_10t.json", "paper_10t.host_bytes_per_node", None,
     "<= declared", 0, ""),
    ("Largest model, best vs pure data parallel (bisected)", "memory.json", "largest_params_ratio_vs_dp", None,
     ">= 10", 2, ""),
    ("Largest model, pure data parallel, parameters", "memory.json", "largest_dp_params", None, "", 2, "M"),
    ("Largest model, best combination, parameters", "memory.json", "largest_best_params", None, "", 2, "M"),
    ("Memory prediction vs measured, max abs. rel. error", "memory.json", "memory_prediction_max_rel_error", None,
     "<= 0.10", 3, ""),
    ("bf16 vs fp32 final held-out loss gap, nats", "memory.json", "bf16_vs_fp32_final_loss_gap", None, "<= 0.05", 3,
     ""),
    ("Gradient-sync bytes saved by split, C = 100,000", "classification.json", "analytic_reduction", None,
     "analytic", 1, "%"),
    ("MoE minus dense final held-out loss, nats", "moe_vs_dense.json", "moe_minus_dense_final_val_loss", None, "< 0",
     3, ""),
    ("Mixed-GPU MoE, aware vs uniform (EMULATED)", "moe.json", "hetero_moe_speedup_over_uniform",
     "hetero_moe_speedup_over_uniform_paired", ">= 0.9 x ideal", 3, ""),
    *[(f"Classification, split vs DP step time, C = 100,000, {n} ranks", "classification.json",
       f"step_time_ratio_split_vs_dp_C100000.{n}", f"step_time_ratio_split_vs_dp_C100000_paired.{n}", "<= 1.0", 3,
       "") for n in ("2", "4")],
    ("Exit teardown: runs that exit 0 (of 20)", "exit_teardown.json", "exit_0", None, "20", 0, ""),
]


def lookup(data, key: str):
    """The value at dotted ``key`` (list items by index) in ``data``.

    Raises:
        KeyError: some part of the path is missing.
    """
    for part in key.split("."):
        if isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            raise KeyError(f"{key!r}: no {part!r}")
    return data


def _scaled(value: float, suffix: str) -> float:
    return value / 1e6 if suffix == "M" else value * 100 if suffix == "%" else value


def cite(file: str, key: str, value, decimals: int, suffix: str = "") -> str:
    """``value`` shown with ``decimals`` (scaled by ``suffix``: ``M`` millions, ``%`` percent) and its source."""
    return f"{_scaled(float(value), suffix):,.{decimals}f}{suffix}<!-- results:{file}:{key} -->"


def _load(file: str, cache: dict):
    if file not in cache:
        path = RESULTS / file
        cache[file] = json.loads(path.read_text()) if path.exists() else None
    return cache[file]


def _met(flag) -> str:
    return {True: "met", False: "**not met**", "unclear": "unclear (IQR straddles the goal)"}.get(flag, "")


def _row(row: tuple, cache: dict) -> str:
    label, file, key, paired_key, goal, dec, suffix = row
    data = _load(file, cache)
    try:
        value = lookup(data, key)
    except (KeyError, TypeError):
        return f"| {label} | not measured | | {goal} | | `{file}` |"
    parent = lookup(data, key.rsplit(".", 1)[0]) if "." in key else {}
    label = label.format(**parent) if isinstance(parent, dict) and "{" in label else label
    number = isinstance(value, int | float) and not isinstance(value, bool)
    shown = cite(file, key, value, dec, suffix) if number else str(value)
    iqr, met = "", ""
    if paired_key:
        try:
            p = lookup(data, paired_key)
            iqr = (f"{cite(file, paired_key + '.q1', p['q1'], dec)} – {cite(file, paired_key + '.q3', p['q3'], dec)}"
                   f" (n = {cite(file, paired_key + '.n', p['n'], 0)})")
            met = _met(p.get("goal_met"))
        except (KeyError, TypeError):
            iqr = "unpaired"
    if not met and isinstance(value, int | float):  # a bool too: goal "true"
        met = _met(_against(float(value), goal))
    return f"| {label} | {shown} | {iqr} | {goal} | {met} | `{file}` |"


GOAL = re.compile(r"^(?P<op><=|>=|<|>) (?P<bound>-?[\d.]+(?:e-?\d+)?)$")
"""A goal a single number meets or not: ``>= 0.95``, ``< 30``, ``<= 1e-6``."""


def _against(value: float, goal: str) -> bool | None:
    """Whether ``value`` meets a :data:`GOAL`, ``0`` or ``true`` (a bool as 1.0); ``None`` for any other goal text
    (``all``, ``>= 0.9 x ideal``, ...)."""
    if goal.strip() in ("0", "true"):
        return value == (0 if goal.strip() == "0" else 1)
    m = GOAL.match(goal.strip())
    if not m:
        return None
    bound = float(m["bound"])
    return {"<=": value <= bound, ">=": value >= bound, "<": value < bound, ">": value > bound}[m["op"]]


def _provenance_rows(cache: dict) -> list[str]:
    out = ["| file | commit | date (UTC) | host load, 1 min (median [min, max]) | cores | wall s |",
           "| --- | --- | --- | --- | --- | --- |"]
    for path in sorted(RESULTS.glob("*.json")):
        p = (_load(path.name, cache) or {}).get("provenance")
        if not p or "load_1min" not in p:
            old = f"`{p['commit'][:12]}` (load before/after only)" if p else "no provenance"
            out.append(f"| `{path.name}` | {old}; written before benchmarks/_provenance.py | | | | |")
            continue
        load = p.get("load_1min", {})
        f = path.name
        out.append(f"| `{f}` | `{p['commit'][:12]}{'+dirty' if p['commit'].endswith('dirty') else ''}` | "
                   f"{p['date']} | {cite(f, 'provenance.load_1min.median', load['median'], 2)} "
                   f"[{cite(f, 'provenance.load_1min.min', load['min'], 2)}, "
                   f"{cite(f, 'provenance.load_1min.max', load['max'], 2)}] | {p.get('cores', '')} | "
                   f"{cite(f, 'provenance.wall_s', p['wall_s'], 0)} |")
        for name, part in p.get("parts", {}).items():
            if "date" not in part:
                keys = ", ".join(f"`{k}`" for k in part.get("keys", ()))
                out.append(f"| `{f}` part `{name}` | {part.get('commit', 'unknown')}: {keys} | | | | |")
                continue
            if "load_1min" not in part:  # a part written before benchmarks/_provenance.py: load before/after
                before_after = ", ".join(f"{v:.2f}" for v in part.get("load_1min_before_after", ()))
                out.append(f"| `{f}` part `{name}` | `{part['commit'][:12]}` | {part['date']} | "
                           f"before/after: {before_after or 'not recorded'} | {part.get('cores', '')} | |")
                continue
            out.append(f"| `{f}` part `{name}` | `{part['commit'][:12]}` | {part['date']} | "
                       f"{cite(f, f'provenance.parts.{name}.load_1min.median', part['load_1min']['median'], 2)} | "
                       f"{part.get('cores', '')} | {cite(f, f'provenance.parts.{name}.wall_s', part['wall_s'], 0)} |")
    return out


def render() -> str:
    """The whole block between the markers (markers included), from the JSONs as they are now."""
    cache: dict = {}
    lines = [BEGIN, "", "<!-- rendered by benchmarks/report.py (make report) from benchmarks/results/*.json; do not "
             "edit by hand -->", "",
             "A-vs-B figures are median paired ratios over ABBA rounds (benchmarks/_paired.py) with their "
             "interquartile range; a goal is *unclear* when the IQR straddles it. EMULATED rows ran on CPU ranks "
             "imitating the declared GPUs.", "",
             "| figure | value | IQR (paired) | goal | met | source |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [_row(r, cache) for r in ROWS]
    lines += ["", "Where each file came from:", ""] + _provenance_rows(cache) + ["", END]
    return "\n".join(lines)


def splice(text: str, block: str) -> str:
    """``text`` with the block between the markers replaced by ``block``.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"docs/benchmarks.md: needs {BEGIN} then {END}; add them where the tables go")
    return text[:i] + block + text[j + len(END):]


def check_citations(text: str) -> list[str]:
    """Every cited number in ``text`` that differs from its JSON at the precision shown, or cites what is not
    there: one line each."""
    bad, cache = [], {}
    for m in CITATION.finditer(text):
        file, key, num, suffix = m["file"], m["key"], m["num"], m["suffix"]
        try:
            value = lookup(_load(file, cache), key)
        except (KeyError, TypeError):
            bad.append(f"{num}{suffix} cites {file}:{key}, which the JSON does not have")
            continue
        decimals = len(num.split(".")[1]) if "." in num else 0
        shown = float(num.replace(",", ""))
        if abs(_scaled(float(value), suffix) - shown) > 0.5 * 10 ** -decimals + 1e-9:
            bad.append(f"{num}{suffix} cites {file}:{key} = {value}")
    return bad


def refresh_citations(text: str) -> tuple[str, int]:
    """``text`` with every cited number rewritten from its JSON at the precision shown (commas kept where the
    number had them), and how many changed. Only the numbers: the prose around them is the writer's to re-read.

    Raises:
        KeyError: a citation names a key its JSON does not have (fix or drop it first).
    """
    cache: dict = {}
    changed = 0

    def one(m: re.Match) -> str:
        nonlocal changed
        num, suffix = m["num"], m["suffix"]
        decimals = len(num.split(".")[1]) if "." in num else 0
        value = _scaled(float(lookup(_load(m["file"], cache), m["key"])), suffix)
        new = f"{value:,.{decimals}f}" if "," in num else f"{value:.{decimals}f}"
        changed += new != num
        return f"{new}{suffix}<!-- results:{m['file']}:{m['key']} -->"

    return CITATION.sub(one, text), changed


def main() -> None:
    """Rewrite the block in docs/benchmarks.md, or with ``--check`` say whether it is current."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the block, or a number cited in README.md or "
                    "docs/*.md, is not what the JSONs give (report.py --refresh DOC fixes the latter)")
    ap.add_argument("--stale", action="store_true", help="list results measured on code other than HEAD's (exit 1 "
                    "when there are any)")
    ap.add_argument("--refresh", nargs="+", metavar="DOC", default=[],
                    help="rewrite the cited numbers in these Markdown files from their JSONs (then re-read the prose)")
    args = ap.parse_args()
    for doc in args.refresh:
        bad = [b for b in check_citations(Path(doc).read_text()) if "which the JSON does not have" in b]
        if bad:
            sys.exit(f"{doc}: {bad[0]} (or the JSON is missing); fix or drop that citation, then --refresh again")
        text, n = refresh_citations(Path(doc).read_text())
        Path(doc).write_text(text)
        print(f"{doc}: {n} cited numbers changed")
    if args.refresh:
        return
    if args.stale:
        lines = stale_results()
        print("\n".join(lines) if lines else "every result was measured on HEAD's code (src, examples, cluster "
              "files, and each benchmark's script with the benchmark modules it imports)")
        sys.exit(1 if lines else 0)
    text = DOC.read_text()
    new = splice(text, render())
    if args.check:
        bad = [f"{doc.relative_to(ROOT)}: {b}" for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
               for b in check_citations(doc.read_text())]
        bad += [] if new == text else ["docs/benchmarks.md: the results block is not what the JSONs give: make report"]
        print("\n".join(bad) if bad else "the results block and every cited number match the JSONs")
        sys.exit(1 if bad else 0)
    DOC.write_text(new)
    print(f"rendered {len(ROWS)} figures into {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
