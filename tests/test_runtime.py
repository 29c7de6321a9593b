"""Runtime behaviour on gloo ranks: checkpoint/resume, step-time errors, metrics."""

from __future__ import annotations

import pytest
import torch

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM, lm_batches, lm_loss


def _engine(ctx, layers=(1, 1)):
    model = TinyLM(stage_layers=layers)
    return wh.parallelize(model, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-2), ctx=ctx)


def _resume(rank, world, ckpt_dir):
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
    data = lm_batches(6, 8)
    straight = _engine(ctx)
    full = [straight.step(b)["loss"] for b in data]

    torch.manual_seed(0)
    first = _engine(ctx)
    part = [first.step(b)["loss"] for b in data[:3]]
    first.save_checkpoint(ckpt_dir, extra={"data_position": 3})

    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    second = _engine(ctx)
    extra = second.load_checkpoint(ckpt_dir)
    rest = [second.step(b)["loss"] for b in data[extra["data_position"]:]]
    return {"full": full, "resumed": part + rest, "step": second.steps_done}


def test_resume_continues_the_same_loss_trajectory(tmp_path):
    results = run_ranks(_resume, 4, str(tmp_path / "ckpt"))
    for r in results:
        assert r["resumed"] == pytest.approx(r["full"], rel=1e-6, abs=0)
        assert r["step"] == 6
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["latest", "step-00000003"]
    inside = sorted(p.name for p in (tmp_path / "ckpt" / "step-00000003").iterdir())
    assert inside == [".metadata", *[f"__{i}_0.distcp" for i in range(4)], "whale.json", "whale.pt"]


def _another_plan(rank, world, ckpt_dir):
    ctx = wh.init(wh.Config(num_micro_batch=1, seed=0))
    eng = _engine(ctx, layers=(2,))
    eng.step(lm_batches(1, 4)[0])
    eng.save_checkpoint(ckpt_dir)
    shares = wh.parallelize(TinyLM(stage_layers=(2,)), lm_loss, lambda ps: torch.optim.AdamW(ps),
                            ctx=wh.Context(ctx.config.replace(load_shares=(3, 1)), rank, world, ctx.device))
    shares.load_checkpoint(ckpt_dir)  # lane shares are a speed setting: the saved ones come back
    restored = shares.plan.lane_weights
    other = wh.parallelize(TinyLM(stage_layers=(2,)), lm_loss, lambda ps: torch.optim.AdamW(ps),
                           ctx=wh.Context(ctx.config.replace(num_micro_batch=2), rank, world, ctx.device))
    other.load_checkpoint(ckpt_dir)  # another plan: loads (resharded), keeps its own shares
    equal = all(torch.equal(a, b) for a, b in zip(other.module.state_dict().values(),
                                                    eng.module.state_dict().values(), strict=True))
    return equal, restored, other.steps_done


def test_checkpoint_loads_under_another_plan_and_keeps_saved_shares_on_the_same_layout(tmp_path):
    for equal, restored, steps in run_ranks(_another_plan, 2, str(tmp_path / "c")):
        assert equal and steps == 1
        assert restored == (1.0, 1.0)


def _step_errors(rank, world):
    ctx = wh.init(wh.Config(num_micro_batch=2))
    eng = _engine(ctx, layers=(2,))
    errors = []
    for batch in (lm_batches(1, 5)[0], lm_batches(1, 2)[0]):
        try:
            eng.step(batch)
        except wh.PlanError as exc:
            errors.append(str(exc))
    ok = eng.step(lm_batches(1, 4)[0])
    return errors, ok


def test_bad_batches_fail_clearly_and_lose_nothing():
    for errors, ok in run_ranks(_step_errors, 2):
        assert "does not divide into num_micro_batch=2" in errors[0]
        assert "2 data-parallel ranks" in errors[1]
        assert ok["loss"] > 0 and ok["samples"] == 4


def _metrics(rank, world):
    ctx = wh.init(wh.Config(num_micro_batch=4))
    eng = _engine(ctx, layers=(1, 1))
    for b in lm_batches(3, 8):
        m = eng.step(b)
    ev = eng.eval_step(lm_batches(1, 8)[0])
    return m, ev, eng.stage_stats()


def test_metrics_eval_and_stage_stats():
    results = run_ranks(_metrics, 2)
    (m0, ev0, stats0), (m1, ev1, _) = results
    assert m0["loss"] == m1["loss"] and ev0["loss"] == ev1["loss"]
    assert m0["stage"] == 0 and m1["stage"] == 1
    assert m0["sync_bytes"] > 0  # the tied embedding is summed across the two stages
    assert [s["stage"] for s in stats0] == [0, 1]
    assert all(0 < s["busy"] <= s["step"] for s in stats0)


def _rebalance(rank, world):
    from whale.runtime.stats import StepTiming

    ctx = wh.init(wh.Config(rebalance_after=1))
    eng = _engine(ctx, layers=(2,))
    first = eng.plan
    eng.step(lm_batches(1, 16)[0])  # rebalance_after=1: re-planned from the measured step, whatever it measured
    automatic = eng.plan
    per_row = [0.01, 0.03][rank]  # injected timings: lane 0 is three times as fast as lane 1
    for rows, slow in ((8, 1), (8, 1), (8, 10), (8, 1)):  # one outlier step (10x): the median ignores it
        eng.history.record(StepTiming(busy=per_row * rows * slow, schedule=1.0, rows=rows))
    measured = eng.rebalance()
    step = eng.step(lm_batches(1, 16)[0])
    return first, automatic, measured, step


def test_rebalance_moves_rows_to_the_measured_faster_device():
    (first, automatic, measured, step), _ = run_ranks(_rebalance, 2)
    assert first.lane_weights == (1.0, 1.0) and "re-balanced" not in " ".join(first.notes)  # never mutated
    assert any("re-balanced" in n for n in automatic.notes)
    assert measured.lane_weights[0] / measured.lane_weights[1] == pytest.approx(3.0)
    assert measured.micro_batch_rows(16) == [[(0, 12)], [(12, 16)]]
    assert step["loss"] > 0
