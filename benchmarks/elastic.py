"""Elastic node loss (issue 29): kill one node's agent mid-run, the survivor re-plans and finishes.

    PYTHONPATH=src:. python benchmarks/elastic.py --out benchmarks/results/elastic.json

Each run (tests/elastic_agents.py): two ``whale launch`` agents, torchrun's elastic agent with the c10d rendezvous
on 127.0.0.1 (``--nnodes 1:2``, 2 workers each), node a (2x V100) and node b (2x P100) of the emulated
examples/clusters/v100_p100_elastic.yaml, the GPT example in a tiny configuration (``--steps`` steps, a checkpoint
every ``--ckpt-every``). Agent b (its process group and its workers) is SIGKILLed when rank 0 logs a step drawn at
random in ``[ckpt_every + 1, steps - 1]``; torchrun restarts the survivor's worker group on world 2, which re-plans for
node a and reshards the newest checkpoint.

* ``node_loss_recovery_seconds``: from the kill to the survivor's first step logged on the new plan (failure
  detection, re-rendezvous with ``last_call_timeout=5``, worker start-up, planning, resharded load, one step).
* ``steps_lost``: last step logged before the kill - the step resumed from (at most the checkpoint interval).
* ``loss_max_abs_diff_vs_reference``: every step's training loss against a run without failure that switches
  from world 4 to world 2 at the resumed step (train there at world 4 in the same rank order, checkpoint, resume
  on node a); ``param_max_abs_diff_vs_reference`` the same for the final parameters.

Timings are on a shared, loaded 2-core host (load average in the provenance) and include emulation delays.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from exit_teardown import provenance  # noqa: E402

from tests import elastic_agents as ea  # noqa: E402
from whale.runtime.checkpoint import read_model_state  # noqa: E402


def _losses(d: Path) -> list[float]:
    return json.loads((d / "summary.json").read_text())["train_loss"]


def _diffs(run_dir: Path, ref_dir: Path) -> tuple[float, float]:
    """Max abs difference of the per-step losses and of the final parameters."""
    a, b = _losses(run_dir), _losses(ref_dir)
    loss = max(abs(x - y) for x, y in zip(a, b, strict=True)) if len(a) == len(b) else float("inf")
    pa, pb = read_model_state(str(run_dir / "ckpt")), read_model_state(str(ref_dir / "ckpt"))
    param = max((pa[k] - pb[k]).abs().max().item() for k in pa) if pa.keys() == pb.keys() else float("inf")
    return loss, param


def one_run(tmp: Path, i: int, args, rng: random.Random, refs: dict) -> dict:
    """One killed run and its reference (cached by switch step and rank order); returns the run's numbers."""
    kill_after = rng.randint(args.ckpt_every + 1, args.steps - 1)
    run = ea.elastic_run(tmp / f"run{i}", args.steps, args.ckpt_every, kill_after, args.data_dir)
    row = {"kill_after_step": kill_after, "rc": run["rc"], "killed": run["killed"],
           "resumed_from": run.get("resumed_from"), "recovery_s": run.get("recovery_s"),
           "replan_note": "elastic: world 4 -> 2: node b (2x P100-16GB) left; re-planned" in run["log_a"]}
    if run["rc"] != 0 or row["resumed_from"] is None:
        (tmp / f"run{i}.log").write_text(run["log_a"] + run["log_b"])
        return row
    row["steps_lost"] = run["last_before_kill"] - row["resumed_from"]
    key = (row["resumed_from"], tuple(run["order"]))
    if key not in refs:
        ref_dir = tmp / f"ref{len(refs)}"
        ref = ea.reference_run(ref_dir, args.steps, args.ckpt_every, key[0], args.data_dir, order=key[1])
        refs[key] = ref_dir if ref["rc4"] == 0 and ref["rc2"] == 0 else None
    if refs[key] is not None:
        row["loss_diff"], row["param_diff"] = _diffs(tmp / f"run{i}", refs[key])
    return row


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=str(ROOT / "data/shakespeare"))
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args()
    load_before, wall0 = os.getloadavg(), time.perf_counter()
    rng, refs, rows = random.Random(args.seed), {}, []
    with tempfile.TemporaryDirectory(prefix="whale-elastic-") as tmp:
        for i in range(args.runs):
            rows.append(one_run(Path(tmp), i, args, rng, refs))
            print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if r["rc"] == 0 and "loss_diff" in r]
    result = {
        "node_loss_recovery_seconds": _stats([r["recovery_s"] for r in ok if r["recovery_s"] is not None]),
        "steps_lost": _stats([r["steps_lost"] for r in ok]),
        "loss_max_abs_diff_vs_reference": max((r["loss_diff"] for r in ok), default=None),
        "param_max_abs_diff_vs_reference": max((r["param_diff"] for r in ok), default=None),
        "runs": len(rows), "runs_ok": len(ok), "checkpoint_interval_steps": args.ckpt_every, "steps": args.steps,
        "rows": rows, "note": "EMULATED cluster (CPU ranks imitate V100/P100); loaded shared 2-core host",
        "provenance": {**provenance(load_before), "wall_time_s": round(time.perf_counter() - wall0, 1)},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
