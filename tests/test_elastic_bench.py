"""benchmarks/elastic.py without processes: the kill moments it draws, the split of a recovery into parts read
from timestamped log lines, and the summary of the rows."""

from __future__ import annotations

import random

from benchmarks import _elastic_runs as er
from benchmarks import elastic as bench


def test_kill_plans_include_a_save_kill_at_a_step_with_an_earlier_checkpoint():
    args = bench.parse_args(["--runs", "6", "--save-kills", "2", "--steps", "14", "--ckpt-every", "4"])
    plans = bench.kill_plans(args, random.Random(1))
    saves = [p["save_step"] for p in plans if "save_step" in p]
    afters = [p["kill_after"] for p in plans if "kill_after" in p]
    assert len(plans) == 6 and len(saves) == 2 and set(saves) <= {8, 12}
    assert all(5 <= k <= 13 for k in afters)


def test_split_parts_in_order_and_a_missing_line_falls_into_the_next_part():
    lines = [(0.5, "error: [rank 2] RuntimeError: a collective failed"), (3.0, "W1206 ... closing signal SIGTERM"),
             (12.0, "[data] cached: x"), (15.0, "GPT: 92,032 parameters, ..."),
             (15.1, "resumed after a restart from /c/step-00000004 at step 4"), (15.2, "step 5/10 loss 7.3")]
    got = er.split_parts(lines, 0.0, er.KILL_PARTS)
    assert got == {"failure_detected_s": 0.5, "group_stopped_s": 2.5, "rendezvous_and_worker_startup_s": 9.0,
                   "plan_and_capture_s": 3.0, "load_checkpoint_s": 0.1, "first_step_s": 0.1}
    got = er.split_parts([x for x in lines if not x[1].startswith("[data]")], 0.0, er.KILL_PARTS)
    assert got["rendezvous_and_worker_startup_s"] is None and got["plan_and_capture_s"] == 12.0
    assert sum(v for v in got.values() if v) == 15.2


def test_summary_counts_only_complete_rows():
    args = bench.parse_args([])
    ok = {"rc": 0, "recovery_s": 20.0, "steps_lost": 4, "loss_diff": 0.0, "param_diff": 0.0,
          "parts": {"first_step_s": 0.1}, "trigger": {"kind": "during_save", "before_kill": {"tmp_exists": True}}}
    failed = {"rc": 1, "recovery_s": None, "trigger": {"kind": "after_step_logged"}}
    join = {"rejoin_s": 30.0, "steps_lost": 0, "loss_diff": 0.0, "param_diff": 0.0, "parts": {"detect_s": 6.0}}
    s = bench.summary([ok, failed], [join], args)
    assert s["runs"] == 2 and s["runs_ok"] == 1 and s["kills_during_save"] == 1
    assert s["node_loss_recovery_seconds"]["median"] == 20.0 and s["rejoin_steps_lost"]["max"] == 0
    assert s["rejoin_recovery_parts_seconds"] == {"detect_s": {"median": 6.0, "max": 6.0, "n": 1}}
