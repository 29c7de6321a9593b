"""Elastic node loss and rejoin (issue 29): kill one node mid-run, or start it again, and time the recovery.

    PYTHONPATH=src:. python benchmarks/elastic.py --out benchmarks/results/elastic.json

Node loss (``--runs``, default 5): two ``whale launch`` agents, torchrun's elastic agent with the c10d rendezvous on
127.0.0.1 (``--nnodes 1:2``, 2 workers each), node a (2x V100) and node b (2x P100) of the emulated
examples/clusters/v100_p100_elastic.yaml, the GPT example in a tiny configuration (``--steps`` steps, a checkpoint
every ``--ckpt-every``). Agent b (its process group and its workers) is SIGKILLed at a random moment; torchrun
restarts the survivor's worker group on world 2, which re-plans for node a and reshards the newest checkpoint.
Two kinds of kill (benchmarks/_elastic_runs.py ``kill_run``), in random order:

* ``after_step_logged``: when the benchmark reads rank 0's log line of a step drawn at random in
  ``[ckpt_every + 1, steps - 1]``;
* ``during_save`` (``--save-kills``, default 2): while the save of a checkpoint step drawn at random from
  ``2 * ckpt_every, 3 * ckpt_every, ... < steps`` is in flight: the benchmark polls the checkpoint directory every
  2 ms and kills while ``.tmp-step-N`` exists and ``step-N`` does not; each row's ``trigger`` records what the
  directory held just before and just after the kill, and ``save_published`` whether that save still completed
  (it can, when rank 0 is on the surviving node and the killed ranks' shards were already written: the job then
  resumes from step N and loses nothing) or not (the job resumes from the checkpoint before it).

Figures: ``node_loss_recovery_seconds`` (the kill to the survivor's first step logged on the new plan),
``steps_lost`` (the last step completed before the kill - the step resumed from; for a kill during the save of
step N, N), ``loss_max_abs_diff_vs_reference`` (every step's training loss against a run without failure that
switches from world 4 to world 2 at the resumed step: ``reference_run``) and ``param_max_abs_diff_vs_reference``.

Rejoin (``--join-runs``, default 5): ``rejoin_run``: node a alone (world 2, no periodic checkpoint) until rank 0 logs
a step drawn at random in ``[--join-after-min, --join-after-max]``, then node b's agent starts; torchrun's SIGTERM
makes a's workers checkpoint at the step boundary and the group re-forms at world 4. ``rejoin_recovery_seconds``:
b's agent start to the first step logged at world 4; ``rejoin_steps_lost``: the step a's workers stopped after -
the step world 4 resumed from; ``rejoin_loss_max_abs_diff_vs_reference``: against ``phases_run`` (node a to that
step, then world 4 in the same rank order).

Every recovery is also split into parts read from the arrival times of the agents' log lines (``part_notes`` in
the JSON says which line ends which part). Timings are on a shared 2-core host (load average in the provenance)
and include emulation delays.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import _elastic_runs as er  # noqa: E402
from benchmarks._provenance import Run  # noqa: E402
from tests import elastic_agents as ea  # noqa: E402


def kill_row(tmp: Path, i: int, args, plan: dict, refs: dict) -> dict:
    """One node-loss run (``plan``: ``kill_after`` or ``save_step``) and its reference (cached by the switch step
    and the rank order); returns the run's numbers."""
    run = er.kill_run(tmp / f"run{i}", args.steps, args.ckpt_every, args.data_dir, **plan)
    row = {**plan, "trigger": run["trigger"], "rc": run["rc"], "killed": run["killed"],
           "resumed_from": run.get("resumed_from"), "recovery_s": run.get("recovery_s"), "parts": run.get("parts"),
           "replan_note": "elastic: world 4 -> 2: node b (2x P100-16GB) left; re-planned" in run["log_a"]}
    if run["rc"] != 0 or row["resumed_from"] is None:
        (tmp / f"run{i}.log").write_text(run["log_a"] + run["log_b"])
        row["log_tail"] = (run["log_a"] + run["log_b"])[-1500:]
        return row
    if "save_step" in plan:  # the kill fell inside the save; did the save still publish (rank 0 survived)?
        row["save_published"] = row["resumed_from"] == plan["save_step"]
    row["last_before_kill"] = run["last_before_kill"]
    row["steps_lost"] = run["last_before_kill"] - row["resumed_from"]
    key = (row["resumed_from"], tuple(run["order"]))
    if key not in refs:
        ref_dir = tmp / f"ref{len(refs)}"
        ref = ea.reference_run(ref_dir, args.steps, args.ckpt_every, key[0], args.data_dir, order=key[1])
        refs[key] = ref_dir if ref["rc4"] == 0 and ref["rc2"] == 0 else None
    if refs[key] is not None:
        row["loss_diff"], row["param_diff"] = er.diffs(tmp / f"run{i}", refs[key])
    return row


def kill_plans(args, rng: random.Random) -> list[dict]:
    """The kill moment of each node-loss run: ``save_kills`` during a random checkpoint save, the rest after a
    random step; in random order."""
    saves = [s for s in range(2 * args.ckpt_every, args.steps, args.ckpt_every)]
    if args.save_kills and not saves:
        raise SystemExit(f"--save-kills needs a checkpoint step >= 2 * --ckpt-every below --steps {args.steps}")
    n_save = min(args.save_kills, args.runs)
    plans = [{"save_step": rng.choice(saves)} for _ in range(n_save)]
    plans += [{"kill_after": rng.randint(args.ckpt_every + 1, args.steps - 1)} for _ in range(args.runs - n_save)]
    rng.shuffle(plans)
    return plans


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "each": [round(x, 3) for x in xs]}


def _parts(rows: list[dict]) -> dict:
    """Median and max of each recovery part over the rows that have it."""
    names = list(dict.fromkeys(k for r in rows for k in (r.get("parts") or {})))
    out = {}
    for k in names:
        xs = [r["parts"][k] for r in rows if (r.get("parts") or {}).get(k) is not None]
        out[k] = {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3), "n": len(xs)} if xs else None
    return out


def _max(rows: list[dict], key: str):
    return max((r[key] for r in rows if key in r), default=None)


def summary(kills: list[dict], joins: list[dict], args) -> dict:
    """The result JSON (without provenance) from the rows."""
    ok = [r for r in kills if r["rc"] == 0 and "loss_diff" in r]
    jok = [r for r in joins if "loss_diff" in r]
    return {
        "node_loss_recovery_seconds": _stats([r["recovery_s"] for r in ok if r["recovery_s"] is not None]),
        "node_loss_recovery_parts_seconds": _parts(ok),
        "steps_lost": _stats([r["steps_lost"] for r in ok]),
        "loss_max_abs_diff_vs_reference": _max(ok, "loss_diff"),
        "param_max_abs_diff_vs_reference": _max(ok, "param_diff"),
        "kills_during_save": sum(r["trigger"].get("kind") == "during_save" and r["trigger"]["before_kill"]
                                 ["tmp_exists"] for r in ok),
        "rejoin_recovery_seconds": _stats([r["rejoin_s"] for r in jok if r["rejoin_s"] is not None]),
        "rejoin_recovery_parts_seconds": _parts(jok),
        "rejoin_steps_lost": _stats([r["steps_lost"] for r in jok]),
        "rejoin_loss_max_abs_diff_vs_reference": _max(jok, "loss_diff"),
        "rejoin_param_max_abs_diff_vs_reference": _max(jok, "param_diff"),
        "part_notes": er.PART_NOTES,
        "runs": len(kills), "runs_ok": len(ok), "rejoin_runs": len(joins), "rejoin_runs_ok": len(jok),
        "checkpoint_interval_steps": args.ckpt_every, "steps": args.steps, "rejoin_steps": args.join_steps,
        "rejoin_checkpoint_interval_steps": 0, "seed": args.seed,
        "kill_timing": "after_step_logged: when the benchmark read rank 0's log line of the drawn step; "
                       "during_save: while ckpt/.tmp-step-N existed and ckpt/step-N did not (polled every 2 ms; "
                       "'trigger' in each row says what was seen just before and after the SIGKILL)",
        "rows": kills, "rejoin_rows": joins,
        "note": "EMULATED cluster (CPU ranks imitate V100/P100); shared 2-core host; seconds are wall time as "
                "the benchmark read the agents' log lines",
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5, help="node-loss runs")
    p.add_argument("--save-kills", type=int, default=2, help="of the node-loss runs, killed during a save")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--join-runs", type=int, default=5, help="rejoin runs")
    p.add_argument("--join-steps", type=int, default=250,
                   help="steps of a rejoin run (node a must still train when b's agent is up)")
    p.add_argument("--join-after-min", type=int, default=5)
    p.add_argument("--join-after-max", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=str(ROOT / "data/shakespeare"))
    p.add_argument("--out", default=None, help="JSON result path")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    run, rng, refs, kills, joins = Run(), random.Random(args.seed), {}, [], []
    with tempfile.TemporaryDirectory(prefix="whale-elastic-") as tmp:
        for i, plan in enumerate(kill_plans(args, rng)):
            kills.append(kill_row(Path(tmp), i, args, plan, refs))
            print(json.dumps(kills[-1]), flush=True)
        for i in range(args.join_runs):
            after = rng.randint(args.join_after_min, args.join_after_max)
            joins.append(er.rejoin_row(Path(tmp), i, args.join_steps, after, args.data_dir))
            print(json.dumps(joins[-1]), flush=True)
    result = summary(kills, joins, args)
    if args.out:
        result = run.write(args.out, result)
    else:
        result["provenance"] = run.record()
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "rejoin_rows", "part_notes")},
                     indent=1))


if __name__ == "__main__":
    main()
