"""Pipeline stages of different widths (a batch bridge re-splits each micro-batch's rows between a stage of n
lanes and one of m): the plan's layout and errors, and training equal to a one-process ``deepcopy`` reference
with the user's AdamW (two param groups) and a token-weighted loss with ignored targets.

Tolerance as in test_equivalence (fp32, rtol 1e-5, atol 1e-6, AdamW lr 1e-3).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import whale as wh
from tests.distributed import run_ranks
from tests.models import TinyLM, lm_batches, mse_side_by_side
from whale.plan.layout import Peer
from whale.plan.plan import Plan, PlanError, TaskGraph
from whale.runtime.checkpoint import read_model_state

RTOL, ATOL = 1e-5, 1e-6


def WidthLM(widths=(2, 1)) -> TinyLM:  # noqa: N802 - reads as the model class it builds
    """Token LM with one block per pipeline stage, stage s annotated ``replicate(widths[s])``; the embedding is
    tied to the head (held by the first and the last stage)."""
    return TinyLM(stage_layers=(1,) * len(widths), stage_widths=widths)


def _groups(model: nn.Module) -> list[dict]:
    """Two AdamW param groups: matrices with weight decay, the rest (biases, norms, pos) without."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 2e-3}]


def _padded(steps: int, batch: int, seed: int):
    """LM batches with some targets ignored (-100), so rows weigh differently in the token-mean loss."""
    out = []
    for i, (x, y) in enumerate(lm_batches(steps, batch, seed=seed)):
        y = y.clone()
        for r in range(batch):
            y[r, (r * 3 + i) % 9:] = -100  # row r keeps (r*3+i) % 9 targets (0..8)
        out.append((x, y))
    return out


def _train(rank, world, spec):
    ctx = wh.init(wh.Config(num_micro_batch=spec["mb"], schedule=spec.get("schedule", "1F1B"),
                            load_shares=spec.get("shares"), seed=0, rebalance_after=spec.get("rebalance")))
    model = WidthLM(spec["widths"])
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(_groups(model), lr=1e-3), torch.optim.AdamW(_groups(ref), lr=1e-3)
    engine = wh.parallelize(model, wh.token_cross_entropy(ignore_index=-100), opt, ctx=ctx)
    losses, ref_losses = [], []
    for x, y in _padded(spec.get("steps", 4), spec["batch"], seed=3):
        losses.append(engine.step((x, y))["loss"])
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    names = []
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
        names.append(name)
    ev = engine.eval_step(_padded(1, spec["batch"], seed=9)[0])
    return {"losses": losses, "names": names, "stage": engine.stage, "lane": engine.lane,
            "plan": engine.plan.to_json(), "eval": ev["loss"]}


def _check(world, spec):
    results = run_ranks(_train, world, spec, timeout=120.0)
    covered = {n for r in results for n in r["names"]}
    expected = {n for n, _ in WidthLM(spec["widths"]).named_parameters(remove_duplicate=False)}
    assert covered == expected, f"parameters never compared: {expected - covered}"
    assert len({tuple(r["losses"]) for r in results}) == 1, "ranks disagree on the global loss"
    assert len({r["eval"] for r in results}) == 1
    return results


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_two_wide_stage_then_one_wide_stage_trains_like_one_process(schedule):
    results = _check(3, {"widths": (2, 1), "batch": 10, "mb": 2, "schedule": schedule})
    plan = Plan.from_json(results[0]["plan"])
    assert plan.stage_widths == (2, 1) and plan.stage_ranks(0) == [0, 1] and plan.stage_ranks(1) == [2]
    assert [(r["stage"], r["lane"]) for r in results] == [(0, 0), (0, 1), (1, 0)]


def test_one_wide_stage_then_two_wide_stage_with_uneven_shares():
    # stage 1's two lanes take 3:1 of every micro-batch (load_shares: stage 0's lane, then stage 1's two)
    results = _check(3, {"widths": (1, 2), "batch": 8, "mb": 2, "shares": (1, 3, 1)})
    plan = Plan.from_json(results[0]["plan"])
    assert plan.stage_lane_weights == ((1.0,), (3.0, 1.0))
    assert [b - a for lane in plan.micro_batch_rows(8, 1) for a, b in lane[:1]] == [3, 1]


def test_three_stages_two_one_two_with_nested_replicas():
    # world 10 = 2 replicas x (2 + 1 + 2): each stage's lanes span both replicas
    _check(10, {"widths": (2, 1, 2), "batch": 8, "mb": 2, "steps": 3})


def test_measured_rebalance_after_two_steps_keeps_training_equal():
    # after step 2 each stage's lanes take shares from their own measured speed (12-row micro-batches, so
    # timing noise cannot leave a lane without rows), and steps 3-4 still equal one process
    results = _check(3, {"widths": (2, 1), "batch": 24, "mb": 2, "steps": 4, "rebalance": 2})
    plan = Plan.from_json(results[0]["plan"])
    assert "lane shares re-balanced from measured step times" in plan.notes
    assert [len(w) for w in plan.stage_lane_weights] == [2, 1] and plan.lane_weights == ()


# --- plan data ------------------------------------------------------------------------------------------------
def _plan(widths=(2, 1), k=1, **kw) -> Plan:
    tgs = tuple(TaskGraph(i, "replicate", n) for i, n in enumerate(widths))
    return Plan(world_size=k * sum(widths), task_graphs=tgs, num_replicas=k, **kw)


def test_layout_rows_and_bridge_peers():
    plan = _plan((2, 1), num_micro_batch=2, stage_lane_weights=((2, 1), (1,)))
    assert [plan.coords(r) for r in range(3)] == [(0, 0), (0, 1), (1, 0)]
    assert plan.micro_batch_rows(12, 0) == [[(0, 4), (6, 10)], [(4, 6), (10, 12)]]
    assert plan.boundary_peers(12, 0, 1) == ((), (Peer(2, 0, 2),))
    assert plan.boundary_peers(12, 1, 0) == ((Peer(0, 0, 4), Peer(1, 4, 6)), ())
    rev = _plan((1, 2), k=2)  # slots: [s0 | s1 s1] per replica
    assert rev.stage_ranks(0) == [0, 3] and rev.stage_ranks(1) == [1, 2, 4, 5]
    assert rev.boundary_peers(8, 0, 1) == ((), (Peer(4, 0, 2), Peer(5, 2, 4)))
    assert Plan.from_json(plan.to_json()) == plan and Plan.from_json(rev.to_json()) == rev


def test_plan_printout_names_each_stage_width_and_its_shares():
    text = str(_plan((2, 1), stage_lane_weights=((3, 1), (1,))))
    assert "stages of different widths" in text and "2+1" in text
    assert "stage 0 lane 0: 75.0%" in text and "stage 1 lane 0: 100.0%" in text
    assert "batch bridge stage 0 -> 1: 2 lane(s) -> 1 lane(s), rows gathered" in text
    assert "rows scattered" in str(_plan((1, 2)))


def test_plan_model_gives_each_stage_its_lanes():
    plan = wh.plan_model(WidthLM((2, 1)), 3, wh.Config(num_micro_batch=2))
    assert plan.stage_widths == (2, 1) and plan.stage_lane_weights == ((1.0, 1.0), (1.0,))
    assert plan.lane_weights == ()


@pytest.mark.parametrize("kw,match", [
    ({"world_size": 4}, r"2\+1 = 3 devices != world size 4"),
    ({"stage_lane_weights": ((1.0,), (1.0,))}, r"stage_lane_weights\[0\] = \[1.0\] must hold 2 positive"),
    ({"lane_weights": (1.0, 1.0)}, r"lane_weights = \[1.0, 1.0\] is for stages of one width"),
    ({"stage_lane_weights": ((1.0, 0.0), (1.0,))}, r"stage_lane_weights\[0\]\[1\] = 0.0 must be a finite number > 0"),
    ({"stage_lane_weights": ((1.0, 1.0),)}, r"must hold one list per stage \(2\)"),
])
def test_inconsistent_plans_are_refused(kw, match):
    base = {"world_size": 3, "task_graphs": (TaskGraph(0, "replicate", 2), TaskGraph(1, "replicate", 1)),
            "num_replicas": 1}
    with pytest.raises(PlanError, match=match):
        Plan(**{**base, **kw})


def test_clear_errors_for_layouts_that_cannot_work():
    with pytest.raises(PlanError, match=r"replicate\(2\) \+ replicate\(1\) need 2\+1 = 3 devices per replica but "
                                        r"world size 4 is not a multiple of 3"):
        wh.plan_model(WidthLM((2, 1)), 4, wh.Config(num_micro_batch=2))
    with pytest.raises(PlanError, match=r"3 rows .* 4 data-parallel ranks in stage 1"):
        _plan((1, 2), k=2).micro_batch_rows(3)
    with pytest.raises(PlanError, match="load_shares has 2 entries but the stages of widths"):
        wh.plan_model(WidthLM((2, 1)), 3, wh.Config(num_micro_batch=2, load_shares=(1, 1)))
    split = (TaskGraph(0, "replicate", 2), TaskGraph(1, "split", 1))
    with pytest.raises(PlanError, match=r"task_graphs\[1\] \(split\(1\).*different device counts \[2, 1\]"):
        Plan(world_size=3, task_graphs=split, num_replicas=1)
    with pytest.raises(PlanError, match="stage widths are"):
        _ = _plan((2, 1)).num_lanes


def test_hardware_aware_plan_balances_each_stage_by_its_own_devices():
    from whale.cluster import ClusterSpec

    spec = ClusterSpec.from_dict({"nodes": [{"devices": ["V100-32GB", "P100-16GB"]}, {"devices": ["T4"]}]})
    sample = _padded(1, 12, seed=1)[0]
    plan = wh.plan_model(WidthLM((2, 1)), 3, wh.Config(num_micro_batch=2), sample_batch=sample, cluster=spec)
    assert plan.stage_widths == (2, 1) and plan.devices and len(plan.predicted_utilization) == 3
    front = plan.stage_lane_weights[0]
    fast = [plan.coords(r)[1] for r in range(3) if plan.devices[r].startswith("V100")][0]
    assert front[fast] > front[1 - fast]  # the V100 lane takes more of each micro-batch than the P100 lane
    assert Plan.from_json(plan.to_json()) == plan
    assert "stage 0 lane" in str(plan)


def test_measured_rebalance_gives_each_stage_its_own_shares():
    from whale.planner.hardware import rebalance

    plan = _plan((1, 2), num_micro_batch=2)
    out = rebalance(plan, [[0.5], [1.0, 0.25]])
    assert out.stage_lane_weights == ((2.0,), (1.0, 4.0)) and out.lane_weights == ()
    with pytest.raises(PlanError, match="rebalance needs 2 lists"):
        rebalance(plan, [0.5, 1.0, 0.25])


def _checkpoint(rank, world, path):
    ctx = wh.init(wh.Config(num_micro_batch=2, seed=0, load_shares=(3, 1, 1)))
    model = WidthLM((2, 1))
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, wh.token_cross_entropy(), torch.optim.AdamW(_groups(model), lr=1e-3), ctx=ctx)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-3)
    for x, y in _padded(2, 8, seed=4):
        engine.step((x, y))
        ref_opt.zero_grad()
        F.cross_entropy(ref(x).flatten(0, 1), y.flatten(), ignore_index=-100).backward()
        ref_opt.step()
    engine.save_checkpoint(path)
    extra = engine.load_checkpoint(path)
    full = read_model_state(path) if rank == 0 else {}
    for name, t in full.items():
        torch.testing.assert_close(t, ref.state_dict()[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    return sorted(full), extra, engine.plan.stage_lane_weights


def test_checkpoint_of_stages_of_different_widths_holds_the_whole_model(tmp_path):
    results = run_ranks(_checkpoint, 3, str(tmp_path / "ckpt"), timeout=120.0)
    assert results[0][0] == sorted(WidthLM((2, 1)).state_dict())
    assert all(r[2] == ((3.0, 1.0), (1.0,)) for r in results)


class _NormedPipe(nn.Module):
    """A 2-wide stage with a BatchNorm (statistics over both lanes' rows), then a 1-wide stage."""

    def __init__(self, d=8):
        super().__init__()
        with wh.replicate(2):
            self.a, self.norm = nn.Linear(d, d), nn.BatchNorm1d(d)
        with wh.replicate(1):
            self.b = nn.Linear(d, d)

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


def _batchnorm(rank, world):
    ctx = wh.init(wh.Config(num_micro_batch=1, seed=0, load_shares=(5, 3, 1)))
    model = _NormedPipe()
    ref = copy.deepcopy(model)
    engine = wh.parallelize(model, F.mse_loss, lambda ps: torch.optim.SGD(ps, lr=0.1), ctx=ctx)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses, ref_losses = mse_side_by_side(engine, ref, ref_opt, 3, (8, 8), (8, 8))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    ref_state = ref.state_dict()
    for name, t in engine.module.state_dict().items():
        torch.testing.assert_close(t, ref_state[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    return losses


def test_batchnorm_in_the_wide_stage_normalizes_over_its_lanes():
    run_ranks(_batchnorm, 3, timeout=120.0)


def test_a_value_that_is_not_per_sample_cannot_cross_a_bridge():
    from whale.parallel.p2p import TransferError
    from whale.parallel.rowbridge import join, slice_for

    x, mask, n = torch.arange(12.0).reshape(6, 2), torch.ones(8), 7
    assert slice_for((x, mask, n), Peer(1, 2, 5), 6, bridged=False)[1] is mask  # regular plans: values pass whole
    with pytest.raises(TransferError, match=r"boundary value 1 has shape \(8,\).*one row per sample in dim 0"):
        slice_for((x, mask, n), Peer(1, 2, 5), 6, bridged=True)
    a, b = slice_for((x, n), Peer(1, 0, 2), 6, True), slice_for((x, n), Peer(1, 2, 6), 6, True)
    assert torch.equal(join([a, b])[0], x) and join([a, b])[1] == n
