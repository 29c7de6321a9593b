"""Straggler re-balancing: the planner's decision exact against brute force (no processes), and a real gloo job
whose rank 1 slows down mid-run, is detected and re-balanced without a restart, with losses equal to a reference
run that switches to the same shares at the same step without a slowdown, and to one process."""

from __future__ import annotations

import copy
import itertools
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM, lm_batches
from whale.elastic.straggler import StragglerController, slow_down
from whale.plan.plan import Plan, PlanError, TaskGraph
from whale.planner.straggler import lane_costs, lane_seconds_per_row, plan_rebalance, predict_step_seconds

CLUSTER = str(Path(__file__).parent / "data" / "two_v100.yaml")


def _dp(lanes: int, m: int = 1) -> Plan:
    return Plan(world_size=lanes, task_graphs=(TaskGraph(0, "replicate", lanes),), num_replicas=1, num_micro_batch=m)


def _best(mb: int, spr: list[float], fixed: list[float]) -> float:
    """Brute force: the slowest lane's compute of the best whole split of one micro-batch (>= 1 row per lane)."""
    best = float("inf")
    for split in itertools.product(range(1, mb + 1), repeat=len(spr)):
        if sum(split) == mb:
            best = min(best, max(f + r * t for r, t, f in zip(split, spr, fixed, strict=True)))
    return best


def test_rebalanced_step_is_the_brute_force_optimum():
    rng = random.Random(3)
    for _ in range(150):
        lanes, m = rng.randint(2, 3), rng.randint(1, 3)
        mb = rng.randint(lanes, 9)
        spr = [rng.choice([0.01, 0.02, rng.uniform(0.001, 0.1)]) for _ in range(lanes)]
        other = rng.uniform(0.0, 0.5)
        fixed = [rng.choice([0.0, rng.uniform(0.0, 0.2)]) for _ in range(lanes)] if rng.random() < 0.5 else None
        d = plan_rebalance(_dp(lanes, m), mb * m, spr, other, remaining_steps=100, switch_s=0.0, threshold=0.0,
                           fixed_s=fixed)
        per_mb = [f / m for f in fixed] if fixed else [0.0] * lanes
        assert d.step_after_s == pytest.approx(other + m * _best(mb, spr, per_mb), rel=1e-12)
        assert d.step_before_s == pytest.approx(predict_step_seconds(_dp(lanes, m), mb * m, spr, other, fixed))
        assert d.step_after_s <= d.step_before_s + 1e-15 and sum(d.rows_after) == mb * m


def test_decision_weighs_gain_against_switch_cost_and_threshold():
    plan = _dp(2)
    slow = [0.01, 0.04]  # lane 1 four times slower: 8 + 8 rows -> 13 + 3
    d = plan_rebalance(plan, 16, slow, 0.1, remaining_steps=50, switch_s=1.0)
    assert d.switch and d.rows_after == (13, 3) and d.speedup == pytest.approx((0.1 + 0.32) / (0.1 + 0.13))
    assert d.gain_s == pytest.approx(50 * (0.32 - 0.13))
    costly = plan_rebalance(plan, 16, slow, 0.1, remaining_steps=50, switch_s=20.0)
    assert not costly.switch and "does not pay" in costly.reason
    noise = plan_rebalance(plan, 16, [0.010, 0.0104], 0.1, remaining_steps=1000, switch_s=0.0)
    assert not noise.switch and "threshold" in noise.reason
    assert lane_seconds_per_row(_dp(2), [(0, 0, 0.1), (0, 1, 0.3)]) == [0.1, 0.3]
    with pytest.raises(PlanError, match="positive seconds-per-row"):
        lane_seconds_per_row(_dp(2), [(0, 0, 0.1)])


def test_lane_costs_fit_the_fixed_part_from_two_row_counts():
    # lane 0: busy = 0.02 + 0.01 * rows, measured at 9 and 3 rows; lane 1 unchanged rows: proportional
    per_row, fixed = lane_costs([(3, 0.05), (13, 0.26)], [(9, 0.11), (13, 0.25)])
    assert per_row == pytest.approx([0.01, 0.02]) and fixed == pytest.approx([0.02, 0.0])
    per_row, fixed = lane_costs([(3, 0.05)], [(9, 0.04)])  # the speed changed in between: proportional
    assert per_row == pytest.approx([0.05 / 3]) and fixed == [0.0]
    with pytest.raises(PlanError, match="lane 0 has 0 rows"):
        lane_costs([(0, 0.1)])
    with pytest.raises(ValueError, match="every >= 1"):
        StragglerController(16, 10, every=0)


def _padded(steps: int, batch: int):
    """LM batches with some targets ignored (-100): rows weigh differently in the token-weighted loss."""
    out = []
    for i, (x, y) in enumerate(lm_batches(steps, batch, seed=5)):
        y = y.clone()
        for r in range(batch):
            y[r, (r * 3 + i) % 9:] = -100
        out.append((x, y))
    return out


def _job(rank, world, slow_at, forced, steps=10, batch=16):
    import os

    os.environ["WHALE_EMULATION_CORES"] = "0.5"  # emulated time (4x the compute), not a loaded host, sets the step
    ctx = wh.init(wh.Config(cluster=CLUSTER, seed=0))
    torch.manual_seed(0)
    model = TinyLM(stage_layers=(2,))
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, wh.token_cross_entropy(ignore_index=-100),
                            lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    rows = [wh.local_rows(engine.plan, rank, batch)]
    ctl = StragglerController(batch, steps, on_switch=lambda p: rows.__setitem__(0, wh.local_rows(p, rank, batch)),
                              every=3, window=3, threshold=0.2, forced=forced, log=None)
    losses, ref_losses = [], []
    for step, (x, y) in enumerate(_padded(steps, batch)):
        if slow_at is not None and step == slow_at and rank == 1:
            slow_down(engine, 4.0)
        m = engine.step_local((x[rows[0]], y[rows[0]]), batch)
        losses.append(m["loss"])
        ctl.after_step(engine, m)
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    return {"losses": losses, "ref": ref_losses, "events": ctl.events, "switch_s": ctl.switch_s,
            "checks": [(c.speedup, c.switch) for c in ctl.checks]}


def test_slowed_rank_is_rebalanced_without_restart_with_reference_losses():
    slowed = run_ranks(_job, 2, 3, None, timeout=120.0)
    events = slowed[0]["events"]
    assert events == slowed[1]["events"], "ranks disagree on the switch"
    assert events, f"no switch after rank 1 slowed down 4x; checks (speedup, switch): {slowed[0]['checks']}"
    last = events[-1]
    assert last["step"] >= 6 and last["rows_after"][1] < last["rows_before"][1]  # rows moved off the straggler
    assert last["predicted_speedup"] > 1.2 and 0 < slowed[0]["switch_s"] < 1.0
    forced = {e["step"]: e["lane_weights"] for e in events}
    reference = run_ranks(_job, 2, None, forced, timeout=120.0)
    assert reference[0]["events"][-1]["rows_after"] == last["rows_after"]
    diff = max(abs(a - b) for a, b in zip(slowed[0]["losses"], reference[0]["losses"], strict=True))
    assert diff <= 1e-6, f"losses differ from the reference run by {diff}"
    torch.testing.assert_close(torch.tensor(slowed[0]["losses"]), torch.tensor(slowed[0]["ref"]), rtol=1e-5,
                               atol=1e-6)


ROOT = Path(__file__).resolve().parents[1]


def test_gpt_example_auto_checkpoint_interval_and_straggler(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from whale.planner.ckpt_interval import checkpoint_interval

    cmd = [str(Path(sys.executable).with_name("whale")), "launch", "-n", "2", "--cluster",
           str(ROOT / "examples/clusters/v100_p100_2.yaml"), str(ROOT / "examples/gpt/train.py"),
           "--data-dir", str(ROOT / "data/shakespeare"), "--batch-size", "16", "--seq-len", "32", "--n-layer", "2",
           "--n-head", "2", "--n-embd", "32", "--micro-batches", "1", "--stages", "1", "--eval-every", "0",
           "--eval-batches", "1", "--sample-tokens", "0", "--tensorboard", "", "--no-progress", "--steps", "24",
           "--ckpt-every", "auto", "--max-lost-seconds", "0.6", "--slowdown-at", "10:0:4", "--stragglers",
           "--ckpt-dir", str(tmp_path / "ck"), "--summary", str(tmp_path / "s.json")]
    # 0.5 emulated cores stretch every rank's compute 4x, so emulated device time, not a loaded host, sets the step
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WHALE_EMULATION_CORES": "0.5"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    adaptive = json.loads((tmp_path / "s.json").read_text())["adaptive"]
    chosen = adaptive["ckpt_interval"]
    again = checkpoint_interval(chosen["step_s"], chosen["save_s"], 0.6, 0.1)
    assert chosen["steps"] == again.steps and proc.stdout.count("--ckpt-every auto:") == 1
    assert adaptive["saved_steps"] == list(range(3, 24, chosen["steps"])), (adaptive["saved_steps"], chosen)
    kept = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "ck").glob("step-*"))
    assert kept == sorted({*adaptive["saved_steps"], 24})[-2:]  # the newest two are kept (checkpoint.save keep=2)
    # slowed after check step 10: the checks at 15 and 20 see only slow steps (earlier switches correct the shares)
    after = [e for e in adaptive["straggler_events"] if e["step"] > 10]
    assert after and after[0]["rows_after"][0] < after[0]["rows_before"][0], adaptive["straggler_events"]
    assert "rank 0's emulated device is 4x slower" in proc.stdout
